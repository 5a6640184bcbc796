"""A pool of isolated scoring processes with a per-call timeout and a per-batch deadline.

Each worker is a fresh interpreter (``python -m megarl.rewards.worker``) connected by a socket pair,
the leader of its own process group (so that anything the user function starts is killed with it),
its stdout and stderr going to one capture file of the pool (never interleaved with the driver's
output; counted, and the start of it logged once). Calls are sent in chunks (one message per chunk,
to amortise IPC); results come back one per call, so the driver knows which call is running and
since when. A call that runs past ``timeout_s`` gets its worker killed and replaced; a worker that
dies (exits, is killed, goes over ``memory_mb``) takes only its current call with it. When a whole
batch runs past ``batch_timeout_s`` the calls still running or waiting are cancelled. All of these
are reported as outcomes (``timeout``, ``crash``), never raised: what a batch of failures means is
the caller's decision. Only a function that cannot even be loaded raises, at construction. A batch
that takes long logs a progress line (INFO) every few seconds.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import megarl
from megarl.errors import ConfigError
from megarl.rewards.worker import MEMORY_EXIT_CODE, Call, ScoringTarget

logger = logging.getLogger(__name__)

STATUSES = ("ok", "error", "bad_return", "timeout", "crash")
# Calls left unrun once a batch had more failures than the caller allows (``stop_after_failures``).
CANCELLED = "cancelled"
PROGRESS_AFTER_S = 5.0  # a batch longer than this logs a progress line ...
PROGRESS_EVERY_S = 5.0  # ... this often
_TICK_S = 0.5  # the longest the driver waits without looking at its workers
_OUTPUT_SAMPLE_BYTES = 300


@dataclass(frozen=True)
class CallOutcome:
    """How one call ended: ``status`` in STATUSES; ``result`` only when ok; ``reason`` otherwise;
    ``finished_at``: ``time.monotonic()`` when the outcome was known (orders failures in time)."""

    status: str
    result: dict[str, float] | None = None
    reason: str = ""
    finished_at: float = field(default_factory=time.monotonic, compare=False)

    @classmethod
    def from_reply(cls, status: str, payload: Any) -> CallOutcome:
        """From a worker's ``(status, payload)``: the result dict when ok, else the reason."""
        return cls(status, result=payload) if status == "ok" else cls(status, reason=payload)


class _WorkerStartError(Exception):
    pass


def exit_reason(code: int | None, memory_mb: float) -> str:
    """Why a worker process ended, in words, from its exit code."""
    if code == MEMORY_EXIT_CODE and memory_mb > 0:
        return f"worker went over its memory limit of {memory_mb:g} MiB resident (reward.worker_memory_mb)"
    if code is not None and code < 0:
        try:
            return f"worker was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"worker was killed by signal {-code}"
    return f"worker exited with code {code}"


class _Worker:
    """One worker process and the calls it has been sent but not yet answered."""

    def __init__(self, target: ScoringTarget, start_timeout_s: float, memory_mb: float, output: int) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(megarl.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        # One thread per worker: the workers are the parallelism; more threads would oversubscribe.
        env["OMP_NUM_THREADS"] = "1"
        env["TOKENIZERS_PARALLELISM"] = "false"
        env["PYTHONUNBUFFERED"] = "1"  # the user's prints reach the capture file as they happen
        self.memory_mb = memory_mb
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megarl.rewards.worker", str(child_sock.fileno()), f"{memory_mb:g}"],
            pass_fds=(child_sock.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killing it kills what it started
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
                f"{exit_reason(self.process.poll(), memory_mb)} while loading: {exc!r}"
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
        """Kill the worker and everything in its process group (what the user function started)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty: the worker and its children are gone already
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

    ``memory_mb`` > 0 caps each worker's resident memory (MiB); 0 leaves it unlimited. Raises
    ConfigError at construction when the target cannot be loaded (missing file, missing function,
    import error, over the memory limit) or takes longer than ``start_timeout_s`` to load.
    ``output_bytes``: what the workers wrote to stdout/stderr so far.
    """

    def __init__(
        self,
        target: ScoringTarget,
        num_workers: int,
        timeout_s: float,
        *,
        start_timeout_s: float = 60.0,
        memory_mb: float = 0.0,
    ) -> None:
        if num_workers < 1:
            raise ConfigError(f"reward num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ConfigError(f"reward timeout_s must be > 0, got {timeout_s}")
        if memory_mb < 0:
            raise ConfigError(f"reward worker_memory_mb must be >= 0 (0: no limit), got {memory_mb}")
        self.target = target
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = start_timeout_s
        self.memory_mb = float(memory_mb)
        self.restarts = 0
        self.output_bytes = 0
        self._output_logged = False
        # One capture file for every worker, appended to (O_APPEND), so that truncating it after
        # each batch keeps it small whatever the workers print.
        self._output = tempfile.TemporaryFile(prefix="megarl-reward-output-")
        fd = self._output.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self._workers: list[_Worker] = []
        try:
            for _ in range(num_workers):
                self._workers.append(self._start())
        except _WorkerStartError as exc:
            self.close()
            raise ConfigError(f"could not load {self.describe()} in a scoring worker: {exc}") from None

    def describe(self) -> str:
        """What this pool runs, in words (file and function name of a user function)."""
        if self.target.path is None:
            return "built-in scorers"
        return f"reward function '{self.target.name}' from '{self.target.path}'"

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _start(self) -> _Worker:
        return _Worker(self.target, self.start_timeout_s, self.memory_mb, self._output.fileno())

    def _replace(self, worker: _Worker) -> _Worker | None:
        worker.kill()
        self.restarts += 1
        try:
            return self._start()
        except _WorkerStartError as exc:
            logger.error("a scoring worker could not be restarted: %s", exc)
            return None

    def _collect_output(self) -> int:
        """Bytes the workers wrote since the last look; the first time, log the start of it."""
        fd = self._output.fileno()
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        if not self._output_logged:
            sample = os.pread(fd, _OUTPUT_SAMPLE_BYTES, 0).decode("utf-8", errors="replace")
            logger.warning(
                "%s wrote to stdout/stderr in its scoring workers (%d bytes in this batch); the output "
                "is captured and counted (reward/worker_output_bytes), not shown. It starts: %r",
                self.describe(), size, sample,
            )
            self._output_logged = True
        os.ftruncate(fd, 0)
        self.output_bytes += size
        return size

    def map(
        self,
        calls: Sequence[Call],
        *,
        batch_timeout_s: float | None = None,
        stop_after_failures: int | None = None,
    ) -> list[CallOutcome]:
        """Score every call; outcomes are in the order of ``calls``. Never raises for a bad call.

        ``batch_timeout_s``: when the batch runs longer, the calls not yet answered are cancelled
        (their workers killed and replaced) and reported as ``timeout``; None: no batch deadline.
        ``stop_after_failures``: once more calls than this have failed, the calls not yet answered
        are not run (status CANCELLED): for a caller to whom such a batch is lost anyway (a function
        that crashes its worker on every call would otherwise restart a worker per call).
        """
        start = time.monotonic()
        batch_deadline = start + batch_timeout_s if batch_timeout_s is not None else math.inf
        next_progress = start + PROGRESS_AFTER_S
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        failures = 0

        def settle(i: int, outcome: CallOutcome) -> None:
            nonlocal failures
            outcomes[i] = outcome
            failures += outcome.status != "ok"
        # Several chunks per worker balance uneven call times; chunks of many calls amortise IPC.
        chunk = max(1, math.ceil(len(calls) / (4 * max(1, len(self._workers)))))
        queue: deque[list[int]] = deque(
            list(range(s, min(s + chunk, len(calls)))) for s in range(0, len(calls), chunk)
        )

        def fail_current(worker: _Worker, status: str, reason: str) -> None:
            """Charge the running call, requeue the rest of the worker's chunk, replace the worker."""
            victim = worker.pending.popleft()
            settle(victim, CallOutcome(status, reason=reason))
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
                    settle(call_id, CallOutcome.from_reply(status, payload))
                    worker.deadline = time.monotonic() + self.timeout_s
            except (EOFError, OSError):
                return False
            return True

        def cancel_the_rest(status: str, reason: str) -> None:
            for worker in [w for w in self._workers if w.pending]:
                queue.appendleft(list(worker.pending))
                worker.pending.clear()
                requeue_and_replace(worker)
            for ids in queue:
                for i in ids:
                    outcomes[i] = CallOutcome(status, reason=reason)
            queue.clear()

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
            now = time.monotonic()
            wake = min(min(w.deadline for w in busy), batch_deadline, next_progress, now + _TICK_S)
            # A worker that dies closes its socket, which wakes this wait too (unless a child it
            # started holds the socket open: the tick then finds the worker gone).
            wait([w.conn for w in busy], timeout=max(0.0, wake - now))
            for worker in busy:
                alive = drain(worker)
                if not worker.pending:
                    continue
                if not alive or worker.process.poll() is not None:
                    fail_current(worker, "crash", f"{exit_reason(worker.exit_code(), self.memory_mb)} during the call")
                elif time.monotonic() >= worker.deadline:
                    fail_current(worker, "timeout", f"call did not return within {self.timeout_s:g} s")
            now = time.monotonic()
            unanswered = bool(queue or any(w.pending for w in self._workers))
            if unanswered and stop_after_failures is not None and failures > stop_after_failures:
                cancel_the_rest(CANCELLED, f"not run: {failures} calls of the batch had failed already")
            elif unanswered and now >= batch_deadline:
                cancel_the_rest(
                    "timeout",
                    f"cancelled: the scoring batch ran past its deadline of {batch_timeout_s:g} s "
                    "(reward.batch_timeout_s)",
                )
            elif now >= next_progress:
                self._log_progress(outcomes, now - start, batch_timeout_s)
                next_progress = now + PROGRESS_EVERY_S
        self._collect_output()
        finished = [o for o in outcomes if o is not None]
        assert len(finished) == len(calls), "every call ends with an outcome"
        return finished

    def _log_progress(
        self, outcomes: Sequence[CallOutcome | None], elapsed: float, batch_timeout_s: float | None
    ) -> None:
        done = [o for o in outcomes if o is not None]
        failed = Counter(o.status for o in done if o.status != "ok")
        logger.info(
            "reward scoring: %d/%d calls done, %d failed%s, %.0f s elapsed%s",
            len(done), len(outcomes), sum(failed.values()),
            f" ({', '.join(f'{k} {v}' for k, v in sorted(failed.items()))})" if failed else "",
            elapsed,
            f" (batch deadline {batch_timeout_s:g} s)" if batch_timeout_s is not None else "",
        )

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for worker in self._workers:
            worker.stop()
        self._workers = []
        output = getattr(self, "_output", None)
        if output is not None and not output.closed:
            self._collect_output()
            output.close()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
