"""The scoring worker process: loads a scoring function once, then scores batches of calls.

Started by :class:`megarl.rewards.pool.ScoringPool` as ``python -m megarl.rewards.worker FD MEMORY_MB``
(a fresh interpreter: it never imports the driver's main module, torch or anything else the driver
holds), as the leader of its own process group, with stdout and stderr sent to the pool's capture
file. With MEMORY_MB > 0 the worker exits with :data:`MEMORY_EXIT_CODE` as soon as its resident
memory goes over MEMORY_MB MiB: checked after every call (so the call that leaked is charged) and by
a watchdog thread while a call runs. Protocol over the connection on file descriptor FD (pickled
tuples):

    parent -> worker   ScoringTarget; then ("score", [(call_id, (data_source, solution_str,
                       ground_truth, extra_info)), ...]) any number of times; ("stop",)
    worker -> parent   ("ready", pid) or ("load_error", reason); then one (call_id, status, payload)
                       per call, in order: ("ok", {key: float}) | ("error", reason) | ("bad_return", reason)

Standard library only, so that starting a worker costs an interpreter start and the user's module.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

Call = tuple[str, str, Any, Any]  # data_source, solution_str, ground_truth, extra_info

# The exit code of a worker whose resident memory went over its limit; the pool reports it as such.
MEMORY_EXIT_CODE = 211
_WATCHDOG_PERIOD_S = 0.05


@dataclass(frozen=True)
class ScoringTarget:
    """What a worker calls. ``path=None`` selects the built-in scorers (``kwargs``: per-scorer options);
    otherwise ``name`` in the Python file ``path``, called as
    ``fn(data_source=, solution_str=, ground_truth=, extra_info=, **kwargs)`` (verl's signature)."""

    path: str | None = None
    name: str = "compute_score"
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def load_user_function(path: str, name: str) -> Callable[..., Any]:
    """Import the file at ``path`` as a module and return its callable ``name``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reward function file '{path}' does not exist")
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:  # let the file import its neighbours
        sys.path.insert(0, directory)
    module_name = f"megarl_user_reward_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"'{path}' cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AttributeError(f"'{path}' has no function '{name}' (callables there: {public})")
    if not callable(fn):
        raise TypeError(f"'{name}' in '{path}' is a {type(fn).__name__}, not a function")
    return fn


def build_scorer(target: ScoringTarget) -> Callable[[Call], Any]:
    if target.path is None:
        from megarl.rewards.scorers import score_builtin

        return lambda call: score_builtin(*call, options=target.kwargs)
    fn = load_user_function(target.path, target.name)
    kwargs = dict(target.kwargs)
    return lambda call: fn(
        data_source=call[0], solution_str=call[1], ground_truth=call[2], extra_info=call[3], **kwargs
    )


class NotScalarError(ValueError):
    """A returned value is an array or tensor of more than one element."""


def _unwrap_scalar(value: Any) -> Any:
    """A numpy scalar (``np.bool_`` too), a 0-d numpy array or a 0-d torch tensor as the Python
    number it holds (by ``.item()``, without importing either library); anything else unchanged.
    NotScalarError (naming the type and shape) for an array or tensor of another shape."""
    if isinstance(value, (numbers.Number, str, bytes)):  # numpy's float64 and int64 are numbers too
        return value
    item, shape = getattr(value, "item", None), getattr(value, "shape", None)
    if not callable(item) or shape is None:
        return value
    try:
        dims = tuple(shape)
    except TypeError:
        return value
    if dims:
        raise NotScalarError(f"{type(value).__name__} of shape {dims}")
    try:
        return item()
    except Exception:  # an object that only looks like an array: reported as the type it is
        return value


def _as_finite_float(value: Any) -> float | None:
    if isinstance(value, (str, bytes)) or not isinstance(value, (numbers.Real, bool)):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def _extra_float(value: Any) -> float | None:
    """An extra key's value as a finite float, or None (the key is dropped): not numeric, not finite,
    or an array of several elements."""
    try:
        return _as_finite_float(_unwrap_scalar(value))
    except NotScalarError:
        return None


def normalize_result(value: Any) -> tuple[str, Any]:
    """``("ok", {"score": float, ...numeric extras})`` or ``("bad_return", reason)``.

    Accepted: a finite real number (bool, int, float, a numpy scalar or ``np.bool_``, a 0-d numpy
    array or torch tensor), or a dict with such a ``score``; the dict's other entries of those kinds
    are kept (as float), the rest dropped (strings, None, lists, arrays of several elements).
    """
    expected = "expected a number (or 0-d array/tensor) or a dict with 'score'"
    try:
        scalar = _unwrap_scalar(value)
    except NotScalarError as exc:
        return "bad_return", f"returned {exc}, not a single number; {expected}"
    score = _as_finite_float(scalar)
    if score is not None:
        return "ok", {"score": score}
    if isinstance(scalar, numbers.Real) and not isinstance(scalar, bool):
        return "bad_return", f"returned {scalar!r}, not a finite number"
    if isinstance(value, Mapping):
        if "score" not in value:
            return "bad_return", f"returned a dict without 'score' (keys: {sorted(map(str, value))[:10]})"
        try:
            score = _as_finite_float(_unwrap_scalar(value["score"]))
        except NotScalarError as exc:
            return "bad_return", f"returned score as {exc}, not a single number"
        if score is None:
            return "bad_return", f"returned score {value['score']!r:.80}, not a finite number"
        kept = {str(k): f for k, v in value.items() if (f := _extra_float(v)) is not None}
        return "ok", {**kept, "score": score}
    return (
        "bad_return",
        f"returned {type(value).__name__} {value!r:.80}, {expected}",
    )


def score_one(scorer: Callable[[Call], Any], call: Call) -> tuple[str, Any]:
    """Run one call; exceptions (even SystemExit) become ``("error", reason)``."""
    try:
        value = scorer(call)
    except BaseException as exc:  # user code may raise anything; the worker must survive it
        if isinstance(exc, KeyboardInterrupt):
            raise
        frames = traceback.extract_tb(exc.__traceback__)
        where = ""
        if frames:
            last = frames[-1]
            where = f" at {os.path.basename(last.filename)}:{last.lineno}"
            if last.line:  # the source line, when the file is readable
                where += f": `{last.line.strip()[:120]}`"
        return "error", f"{type(exc).__name__}: {str(exc)[:300]}{where}"
    return normalize_result(value)


def resident_mb() -> float:
    """This process's resident memory in MiB (Linux: current, from /proc; elsewhere: the peak)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _exit_over_memory(limit_mb: float) -> None:
    if resident_mb() > limit_mb:
        os._exit(MEMORY_EXIT_CODE)


def _watch_memory(limit_mb: float) -> None:
    """Runs in a thread: a call that keeps allocating is stopped before it returns."""
    while True:
        _exit_over_memory(limit_mb)
        time.sleep(_WATCHDOG_PERIOD_S)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Runs in a thread: the worker must not outlive the driver, even mid-way through a hung call;
    it takes its process group (anything the user function started) with it."""
    while True:
        if os.getppid() != parent_pid:
            if os.getpgrp() == os.getpid():
                os.killpg(os.getpid(), signal.SIGKILL)
            os._exit(1)
        time.sleep(1.0)


def serve(conn: Connection, memory_mb: float = 0.0) -> None:
    target: ScoringTarget = conn.recv()
    try:
        scorer = build_scorer(target)
    except BaseException as exc:
        conn.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    if memory_mb > 0:  # a module that is over the limit once loaded never reports ready
        _exit_over_memory(memory_mb)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent went away
            return
        if message[0] == "stop":
            return
        for call_id, call in message[1]:
            status, payload = score_one(scorer, call)
            if memory_mb > 0:
                _exit_over_memory(memory_mb)
            conn.send((call_id, status, payload))


def main() -> None:
    fd, memory_mb = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    if memory_mb > 0:
        threading.Thread(target=_watch_memory, args=(memory_mb,), daemon=True).start()
    serve(Connection(fd), memory_mb)


if __name__ == "__main__":
    main()
