"""Pieces every benchmark section shares: machine facts, load average, peak memory of a process
tree, and JSON output.

Peak memory method (used for megarl and TRL alike): a thread samples, every ``interval_s``, the
resident set size (RSS) of a root process and all of its descendants with psutil, sums them, and
keeps the largest sum seen. Two sums are kept:

- ``workload``: the root (the driver, or TRL's single process) plus every descendant that is not
  one of Ray's own daemons (GCS server, raylet, dashboard, log monitor, agents) - i.e. the driver,
  the Ray worker processes and the reward scoring processes;
- ``tree``: every process of the tree, Ray's daemons included.

RSS counts shared pages (the torch libraries mapped by every worker) once per process, so the
sums overstate the machine's physical use; they are comparable between the two systems because
both are measured the same way. Peaks shorter than the interval can be missed.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# Command-line fragments of Ray's own daemons (not part of the workload being measured).
RAY_DAEMON_MARKERS = (
    "gcs_server",
    "raylet",
    "dashboard",
    "log_monitor",
    "runtime_env",
    "ray/autoscaler",
    "monitor.py",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "ray_client_server",
)


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages of the machine, rounded (empty where unsupported)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# CPU flags (as /proc/cpuinfo names them) that change how fast torch's CPU kernels run, with the
# names the report gives them: fp32 matmuls use the widest vector unit, bf16 ones AMX where present.
CPU_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX"))


def cpu_description(cpuinfo: str | None = None) -> str | None:
    """The CPU's model name and its matmul-relevant features, e.g. "Intel(R) Xeon(R) Processor
    (AVX2, AVX-512, AVX-512 BF16, AMX)"; None where /proc/cpuinfo cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first processor's block is enough
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    features = [name for flag, name in CPU_FEATURES if flag in flags]
    return f"{model} ({', '.join(features)})" if features else model


def utc_now() -> str:
    """The time now, UTC, as bench records write it (2026-01-01T00:00:00Z)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def machine_info() -> dict[str, Any]:
    """Facts a reader needs to judge a number: CPU model and count, Python, torch version, load, time."""
    info: dict[str, Any] = {
        "cpu": cpu_description(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": load_average(),
        "utc": utc_now(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # the report writer runs without torch
        pass
    return info


def is_ray_daemon(cmdline: list[str]) -> bool:
    """Whether a command line is one of Ray's daemons; only the program and script names count
    (a worker's own arguments may mention the dashboard or the runtime-env agent)."""
    text = " ".join(cmdline[:3])
    return any(marker in text for marker in RAY_DAEMON_MARKERS)


class PeakMemorySampler:
    """Largest summed RSS (MiB) of a process tree, sampled in a background thread.

    Use as a context manager around the lifetime of the root process::

        proc = subprocess.Popen(...)
        with PeakMemorySampler(proc.pid) as mem:
            proc.wait()
        mem.result()  # {"workload_mib": ..., "tree_mib": ..., "samples": ..., "interval_s": ...}
    """

    def __init__(self, root_pid: int, interval_s: float = 0.1) -> None:
        import psutil

        self._psutil = psutil
        self.root_pid = root_pid
        self.interval_s = interval_s
        self.peak_workload = 0
        self.peak_tree = 0
        self.max_processes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self._daemon_pids: dict[int, bool] = {}

    def __enter__(self) -> PeakMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _is_daemon(self, proc: Any) -> bool:
        if proc.pid not in self._daemon_pids:
            try:
                self._daemon_pids[proc.pid] = is_ray_daemon(proc.cmdline())
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied, self._psutil.ZombieProcess):
                return False
        return self._daemon_pids[proc.pid]

    def sample(self) -> None:
        psutil = self._psutil
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return
        tree = workload = 0
        for proc in procs:
            try:
                rss = proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            tree += rss
            if proc is root or not self._is_daemon(proc):
                workload += rss
        self.samples += 1
        self.peak_tree = max(self.peak_tree, tree)
        self.peak_workload = max(self.peak_workload, workload)
        self.max_processes = max(self.max_processes, len(procs))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def result(self) -> dict[str, Any]:
        return {
            "workload_mib": round(self.peak_workload / 2**20, 1),
            "tree_mib": round(self.peak_tree / 2**20, 1),
            "max_processes": self.max_processes,
            "samples": self.samples,
            "interval_s": self.interval_s,
        }


def write_json(path: Path | str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    text = json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n"
    # Paths inside the repository are recorded relative to it, so results do not name this machine.
    text = text.replace(str(REPO_ROOT) + "/", "")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def parameter_count(model_dir: Path, skip: tuple[str, ...] = ()) -> int | None:
    """Parameters of a saved HF model, from its safetensors headers (no weights loaded), leaving out
    the tensors whose name ends with one of `skip`; None when the folder holds no weights."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__" and not name.endswith(skip):
                total += math.prod(info["shape"])
    return total or None


def matmul_flops(size: int, repeats: int = 10, threads: Optional[int] = None,
                 dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of `torch.mm` on square `dtype` matrices (best of `repeats`), with `threads` torch
    threads (None: the process's current setting)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2.0 * size ** 3 / best


def in_world_of_one(run: Callable[[Any], Any]) -> Any:
    """`run(layout)` in a gloo world of one rank on a free local port (Megatron's groups all of size
    one); the world is torn down afterwards, whatever `run` raised."""
    # Imported here: Megatron-Core is slow to import, and most users of this module start no world.
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import destroy_distributed, init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = init_distributed(0, 1, "127.0.0.1", port, ParallelLayout())
    try:
        return run(layout)
    finally:
        destroy_distributed()


def alternating_times(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each function, `repeats` calls each after one warm-up call. Calls
    alternate between the functions, so that load from other processes on a shared machine falls on
    all of them alike (on CUDA each call is timed between two synchronisations)."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return times
