"""Waiting on remote calls so that a failed rank fails the driver at once, with its own error.

Every call into a worker group goes through `wait_for_calls`: it waits with `ray.wait` over all
pending results together, so the first rank that raises or dies is seen at once, even while the
other ranks are blocked in a collective waiting for it. The error names the role, rank and node
and carries the worker's own traceback. `CallHandle` is the future-like result of an `_async`
call; `gather` waits on several handles (from several groups) together.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError, RayError, RayTaskError

from megarl.errors import WorkerError


class WorkerTimeoutError(WorkerError):
    """A call into a worker group did not finish within its timeout."""


@dataclass(frozen=True)
class RankCall:
    """One pending remote call: who runs it and the reference to its result."""

    role: str
    rank: int
    node: str  # for messages, after "node": "ip (host, node id prefix, pid)", or the pool's node before that is known
    method: str
    ref: ray.ObjectRef


def _where(call: RankCall) -> str:
    return f"{call.role} rank {call.rank} on node {call.node}"


def describe_failure(call: RankCall, error: BaseException) -> str:
    """The message of the WorkerError for `call` failing with `error` (a Ray error or other)."""
    where = _where(call)
    if isinstance(error, RayTaskError):
        # str() holds the remote traceback and the original exception's message.
        return f"{where} raised in {call.method}():\n{plain_text(error)}"
    if failed_in_constructor(error):
        # Every call to such an actor fails with this error, the first (node_info) included: the
        # cause is the constructor's, not the call's.
        return f"{where} failed in its constructor:\n{constructor_error(error)}"
    if isinstance(error, RayActorError):
        return f"{where} died during {call.method}(): {death_reason(error)}"
    return f"{where} failed in {call.method}(): {type(error).__name__}: {error}"


def failed_in_constructor(error: BaseException) -> bool:
    """True for Ray's error of a call to an actor whose constructor raised (its creation task failed)."""
    return isinstance(error, ActorDiedError) and error.actor_init_failed


_CREATION_TASK_PREFIX = "The actor died because of an error raised in its creation task, "
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def plain_text(error: BaseException) -> str:
    """`str(error)` without the ANSI colour codes Ray puts in a remote error's text (its process title)."""
    return _ANSI_ESCAPE.sub("", str(error))


# Lines of a constructor's traceback kept in the message: the raising frames and the exception.
CONSTRUCTOR_TRACEBACK_LINES = 20


def constructor_error(error: ActorDiedError) -> str:
    """The end of the constructor's traceback and its exception, from Ray's actor-death text."""
    text = plain_text(error).removeprefix(_CREATION_TASK_PREFIX)
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return "\n".join(lines[-CONSTRUCTOR_TRACEBACK_LINES:])


_EXIT_TYPE = re.compile(r"Worker exit type: (\S+)")
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.*?)(?: Some common causes|$)", re.DOTALL)


def death_reason(error: RayActorError) -> str:
    """Why a worker process is gone, in one line, from Ray's multi-line actor-death text.

    Ray's text lists the actor id, namespace and a paragraph of possible causes; what tells
    them apart is the worker's exit type and detail, kept here. A process that vanished without
    a word (SIGKILL, the kernel's OOM killer, a segfault) reads "its process exited unexpectedly".
    """
    text = str(error)
    exit_type = _EXIT_TYPE.search(text)
    detail = _EXIT_DETAIL.search(text)
    if exit_type is None:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1][:300] if lines else type(error).__name__
    reason = f"exit type {exit_type.group(1)}"
    if detail is not None:
        reason += f", {' '.join(detail.group(1).split())[:300]}"
    if exit_type.group(1) in ("SYSTEM_ERROR", "NODE_OUT_OF_MEMORY"):
        return f"its process exited unexpectedly (killed, e.g. by SIGKILL or the OOM killer, or crashed; {reason})"
    return f"its process exited ({reason})"


def _summary(call: RankCall, error: BaseException) -> str:
    """One line: who failed and the last line of its error."""
    lines = [line for line in plain_text(error).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else type(error).__name__
    if failed_in_constructor(error):
        return f"{_where(call)} failed in its constructor: {last}"
    if isinstance(error, RayActorError):
        return f"{_where(call)} died: {death_reason(error)}"
    return f"{_where(call)} raised: {last}"


def _root_cause_order(failure: tuple[RankCall, BaseException]) -> tuple[bool, int]:
    call, error = failure
    return (not isinstance(error, RayActorError), call.rank)


def _failure_message(failures: list[tuple[RankCall, BaseException]]) -> str:
    """Root cause first: a rank that died explains the others' broken collectives, not vice versa."""
    failures = sorted(failures, key=_root_cause_order)
    call, error = failures[0]
    message = describe_failure(call, error)
    if len(failures) > 1:
        message += "\nAlso failed:\n" + "\n".join("  " + _summary(c, e) for c, e in failures[1:])
    return message


FailureAction = Callable[[Sequence[int]], None]

# Seconds to wait for further failures once one rank has failed (see wait_for_calls).
FAILURE_GRACE_S = 2.0


def _fetch(calls: Sequence[RankCall], positions: Sequence[int], results: list[Any]) -> list[int]:
    """Store the results of the finished calls at `positions`; return the positions that failed."""
    failed = []
    for position in positions:
        try:
            results[position] = ray.get(calls[position].ref)
        except RayError as error:
            results[position] = error
            failed.append(position)
    return failed


def wait_for_calls(
    calls: Sequence[RankCall],
    timeout_s: float | None = None,
    on_failure: FailureAction | None = None,
) -> list[Any]:
    """Results of `calls` in order; raise WorkerError on the first failing rank.

    timeout_s: None waits for ever; otherwise WorkerTimeoutError names the ranks still running.
    on_failure: called before raising, with the positions (in `calls`) of the failed call or of
    the calls still running at a timeout. A worker group kills its actors here, so that ranks
    left blocked in a collective do not hang around.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    position_of = {call.ref: position for position, call in enumerate(calls)}
    results: list[Any] = [None] * len(calls)
    pending = [call.ref for call in calls]
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            positions = [position_of[ref] for ref in pending]
            if on_failure is not None:
                on_failure(positions)
            raise WorkerTimeoutError(
                f"{calls[positions[0]].method}() did not finish within {timeout_s} s on "
                + ", ".join(_where(calls[p]) for p in positions)
            )
        failed = _fetch(calls, [position_of[ref] for ref in ready], results)
        if failed:
            # Give the other ranks a moment to report too, so the root cause (often a rank that
            # died, while its peers only see a broken connection) can be named first.
            if pending:
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
                failed += _fetch(calls, [position_of[ref] for ref in more], results)
            if on_failure is not None:
                on_failure(failed)
            failures = [(calls[position], results[position]) for position in failed]
            message = _failure_message(failures)
            raise WorkerError(message) from min(failures, key=_root_cause_order)[1]
    return results


class CallHandle:
    """The result of an asynchronous group call: `.result(timeout_s)` waits and post-processes."""

    def __init__(
        self,
        calls: Sequence[RankCall],
        finish: Callable[[list[Any]], Any],
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.calls = list(calls)
        self._finish = finish
        self.on_failure = on_failure
        self._done = False
        self._value: Any = None

    def done(self) -> bool:
        """True when every rank has finished (successfully or not); never blocks."""
        if self._done:
            return True
        refs = [call.ref for call in self.calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait (at most timeout_s seconds) and return the call's result; raises WorkerError."""
        if not self._done:
            action = self.on_failure
            raw = wait_for_calls(self.calls, timeout_s, None if action is None else lambda _: action())
            self._value = self._finish(raw)
            self._done = True
        return self._value


def gather(*handles: CallHandle, timeout_s: float | None = None) -> list[Any]:
    """Results of several handles (possibly of different groups), waiting on all at once.

    The first failure in any of them raises at once, after the failure action of the handle it
    belongs to (its group's) has run. Use this when independent roles run concurrently, so that
    a crash in one is not hidden behind a long wait on another.
    """
    calls = [call for handle in handles for call in handle.calls]
    owner = [handle for handle in handles for _ in handle.calls]

    def fail(positions: Sequence[int]) -> None:
        # Once per group: handles of one group (e.g. one per rank) carry equal bound methods.
        for action in dict.fromkeys(owner[p].on_failure for p in positions):
            if action is not None:
                action()

    wait_for_calls(calls, timeout_s, fail)
    # Every call is finished now, so each handle's result() returns without waiting.
    return [handle.result() for handle in handles]
