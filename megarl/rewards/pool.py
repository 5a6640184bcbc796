"""A pool of isolated scoring processes with a per-call timeout.

Each worker is a fresh interpreter (``python -m megarl.rewards.worker``) connected by a socket pair.
Calls are sent in chunks (one message per chunk, to amortise IPC); results come back one per call,
so the driver knows which call is running and since when. A call that runs past ``timeout_s`` gets
its worker killed and replaced; a worker that dies takes only its current call with it. Both are
reported as outcomes (``timeout``, ``crash``), never raised: a bad reward function costs samples,
not the training run. Only a function that cannot even be loaded raises, at construction.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import megarl
from megarl.errors import ConfigError
from megarl.rewards.worker import Call, ScoringTarget

logger = logging.getLogger(__name__)

STATUSES = ("ok", "error", "bad_return", "timeout", "crash")


@dataclass(frozen=True)
class CallOutcome:
    """How one call ended: ``status`` in STATUSES; ``result`` only when ok; ``reason`` otherwise."""

    status: str
    result: dict[str, float] | None = None
    reason: str = ""

    @classmethod
    def from_reply(cls, status: str, payload: Any) -> CallOutcome:
        """From a worker's ``(status, payload)``: the result dict when ok, else the reason."""
        return cls(status, result=payload) if status == "ok" else cls(status, reason=payload)


class _WorkerStartError(Exception):
    pass


class _Worker:
    """One worker process and the calls it has been sent but not yet answered."""

    def __init__(self, target: ScoringTarget, start_timeout_s: float) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(megarl.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        # One thread per worker: the workers are the parallelism; more threads would oversubscribe.
        env["OMP_NUM_THREADS"] = "1"
        env["TOKENIZERS_PARALLELISM"] = "false"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megarl.rewards.worker", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.pending: deque[int] = deque()
        self.deadline = math.inf
        try:
            self.conn.send(target)
            if not self.conn.poll(start_timeout_s):
                raise _WorkerStartError(f"did not load within {start_timeout_s:.0f} s")
            kind, detail = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.kill()
            raise _WorkerStartError(
                f"exited while loading (exit code {self.process.poll()}): {exc!r}"
            ) from None
        except _WorkerStartError:
            self.kill()
            raise
        if kind != "ready":
            self.kill()
            raise _WorkerStartError(detail)

    def exit_code(self) -> int | None:
        """The exit code of a worker whose socket closed (it may take a moment to be reaped)."""
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
            self.process.wait(timeout=2.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class ScoringPool:
    """``num_workers`` isolated processes that score calls with ``target``; see the module doc.

    Raises ConfigError at construction when the target cannot be loaded (missing file, missing
    function, import error) or takes longer than ``start_timeout_s`` to load.
    """

    def __init__(
        self, target: ScoringTarget, num_workers: int, timeout_s: float, *, start_timeout_s: float = 60.0
    ) -> None:
        if num_workers < 1:
            raise ConfigError(f"reward num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ConfigError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.target = target
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._workers: list[_Worker] = []
        try:
            for _ in range(num_workers):
                self._workers.append(_Worker(target, start_timeout_s))
        except _WorkerStartError as exc:
            self.close()
            what = (
                "built-in scorers"
                if target.path is None
                else f"reward function '{target.name}' from '{target.path}'"
            )
            raise ConfigError(f"could not load {what} in a scoring worker: {exc}") from None

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _replace(self, worker: _Worker) -> _Worker | None:
        worker.kill()
        self.restarts += 1
        try:
            return _Worker(self.target, self.start_timeout_s)
        except _WorkerStartError as exc:
            logger.error("a scoring worker could not be restarted: %s", exc)
            return None

    def map(self, calls: Sequence[Call]) -> list[CallOutcome]:
        """Score every call; outcomes are in the order of ``calls``. Never raises for a bad call."""
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        # Several chunks per worker balance uneven call times; chunks of many calls amortise IPC.
        chunk = max(1, math.ceil(len(calls) / (4 * max(1, len(self._workers)))))
        queue: deque[list[int]] = deque(
            list(range(s, min(s + chunk, len(calls)))) for s in range(0, len(calls), chunk)
        )

        def fail_current(worker: _Worker, status: str, reason: str) -> None:
            """Charge the running call, requeue the rest of the worker's chunk, replace the worker."""
            victim = worker.pending.popleft()
            outcomes[victim] = CallOutcome(status, reason=reason)
            requeue_and_replace(worker)

        def requeue_and_replace(worker: _Worker) -> None:
            if worker.pending:
                queue.appendleft(list(worker.pending))
                worker.pending.clear()
            slot = self._workers.index(worker)
            replacement = self._replace(worker)
            if replacement is None:
                del self._workers[slot]
            else:
                self._workers[slot] = replacement

        def drain(worker: _Worker) -> bool:
            """Read every answer waiting; False when the worker is gone."""
            try:
                while worker.pending and worker.conn.poll(0):
                    call_id, status, payload = worker.conn.recv()
                    if call_id != worker.pending[0]:
                        raise RuntimeError(
                            f"scoring worker answered call {call_id}, expected {worker.pending[0]}"
                        )
                    worker.pending.popleft()
                    outcomes[call_id] = CallOutcome.from_reply(status, payload)
                    worker.deadline = time.monotonic() + self.timeout_s
            except (EOFError, OSError):
                return False
            return True

        while queue or any(w.pending for w in self._workers):
            if not self._workers:
                for i, outcome in enumerate(outcomes):
                    if outcome is None:
                        outcomes[i] = CallOutcome("crash", reason="no scoring worker could be (re)started")
                break
            for worker in list(self._workers):
                if queue and not worker.pending and worker.process.poll() is not None:
                    requeue_and_replace(worker)  # died while idle (e.g. killed from outside)
                    continue
                if queue and not worker.pending:
                    ids = queue.popleft()
                    worker.pending.extend(ids)
                    worker.deadline = time.monotonic() + self.timeout_s
                    try:
                        worker.conn.send(("score", [(i, calls[i]) for i in ids]))
                    except OSError:  # died while idle: nothing ran, so nothing is charged
                        requeue_and_replace(worker)
            busy = [w for w in self._workers if w.pending]
            if not busy:
                continue
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            # A worker that dies closes its socket, which wakes this wait too.
            wait([w.conn for w in busy], timeout=wait_s)
            for worker in busy:
                alive = drain(worker)
                if not worker.pending:
                    continue
                if not alive or worker.process.poll() is not None:
                    fail_current(
                        worker, "crash", f"worker exited with code {worker.exit_code()} during the call"
                    )
                elif time.monotonic() >= worker.deadline:
                    fail_current(worker, "timeout", f"call did not return within {self.timeout_s:g} s")
        finished = [o for o in outcomes if o is not None]
        assert len(finished) == len(calls), "every call ends with an outcome"
        return finished

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
