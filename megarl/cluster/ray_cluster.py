"""Starting or joining a Ray cluster, and leaving nothing behind when the driver stops.

    with start_or_connect() as cluster:            # a local cluster for this process
        pool = ResourcePool("actor", nnodes=1, devices_per_node=2)
        ...
    # here every worker group and pool is gone, and so is the local cluster

On exit, on Ctrl-C (KeyboardInterrupt) and on SIGTERM (`StoppedBySignal`, a SystemExit, out of the
block) the context manager shuts down the worker groups and resource pools created inside it, then
disconnects from Ray; a local cluster stops with it. An atexit hook does the same if the block
was never left normally. When nothing in this process can run (SIGKILL), the reaper of a local
cluster (megarl.cluster.reaper) kills its processes: every process started while the block is
open carries the cluster's tag (`MEGARL_LOCAL_CLUSTER_TAG`) and is killed when the block exits or
the process dies, so one that must outlive the block is started without that variable.

Code that can stop where nothing is lost (the training loop: between steps) takes SIGTERM as a
request instead, inside `stop_on_signal()`, and polls it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import ray

from megarl.cluster.reaper import TAG_ENV as REAPER_TAG_ENV
from megarl.cluster.reaper import start_reaper
from megarl.errors import MegarlError

logger = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
# How long a Ray process waits for each try at reaching the GCS. A worker that raylet was still
# starting when the driver's process group was SIGKILLed knows nothing of the dead GCS and tries
# it several times before giving up: about 25 s with Ray's default on an idle 2-core machine,
# over 60 s on a loaded one; 2 s a try makes it about 10 s. The GCS of a local cluster runs on the
# same host, where a connection takes milliseconds, so 2 s a try leaves ample margin.
LOCAL_GCS_CONNECT_ENV = "RAY_gcs_rpc_server_connect_timeout_s"
LOCAL_GCS_CONNECT_TIMEOUT_S = "2"


class ClusterError(MegarlError, RuntimeError):
    """The Ray cluster cannot be reached or does not have what was asked of it."""


class _ShutsDown(Protocol):
    def shutdown(self) -> None: ...


# Worker groups and resource pools register here so that the cluster's exit can clean them up.
_live: weakref.WeakSet[Any] = weakref.WeakSet()


def register_for_cleanup(resource: _ShutsDown) -> None:
    """Shut `resource` down when the surrounding `start_or_connect` block exits."""
    _live.add(resource)


def unregister_for_cleanup(resource: _ShutsDown) -> None:
    _live.discard(resource)


def shutdown_registered() -> None:
    """Shut down every registered worker group, then every pool (groups first: they use pools)."""
    resources = list(_live)
    resources.sort(key=lambda resource: 0 if hasattr(resource, "pool") else 1)  # groups have a pool
    for resource in resources:
        try:
            resource.shutdown()
        except Exception as error:  # cleanup must go on with the rest
            logger.warning("cleanup of %r failed: %s", resource, error)
        _live.discard(resource)


@dataclass(frozen=True)
class ClusterInfo:
    """What the driver is connected to."""

    address: str
    local: bool  # True when this process started the cluster (and will stop it)
    num_nodes: int
    resources: dict[str, float]
    # The number of a SIGTERM received inside the block, once one was: read by code that takes over
    # SIGTERM later (`stop_on_signal(pending=...)`), since the interrupt it raised can be lost (Python
    # ignores an exception raised while a finalizer or a weakref callback runs).
    sigterm: list[int] = field(default_factory=list)


@contextmanager
def start_or_connect(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    object_store_memory_gb: float = 0.5,
    resources: dict[str, float] | None = None,
    namespace: str | None = None,
    wait_for_nodes: int = 1,
    wait_timeout_s: float = 60.0,
    log_to_driver: bool = True,
) -> Iterator[ClusterInfo]:
    """Start a local Ray cluster (address=None) or connect to a running one; tear down on exit.

    address: "host:port" of a running cluster's GCS, or "auto"; None starts a local cluster with
    num_cpus/num_gpus logical devices, `object_store_memory_gb` of shared memory and custom
    `resources`. Token authentication (on by default in Ray 2.60) is switched off only for
    this local, single-process cluster unless RAY_AUTH_MODE is set; a real cluster keeps it.
    wait_for_nodes: block until this many nodes are alive (multi-node clusters still joining);
    ClusterError after wait_timeout_s.
    """
    if ray.is_initialized():
        raise ClusterError("Ray is already initialised in this process; start_or_connect owns the connection")
    local = address is None
    auth_env_before = os.environ.get(AUTH_MODE_ENV)
    if local and auth_env_before is None:
        os.environ[AUTH_MODE_ENV] = "disabled"
    connect_env_before = os.environ.get(LOCAL_GCS_CONNECT_ENV)
    if local and connect_env_before is None:  # inherited by the GCS, raylet and every worker
        os.environ[LOCAL_GCS_CONNECT_ENV] = LOCAL_GCS_CONNECT_TIMEOUT_S
    # A local cluster's processes carry a tag of it; the reaper kills them if this process dies
    # without stopping them (megarl.cluster.reaper).
    tag_before = os.environ.get(REAPER_TAG_ENV)
    reaper = None
    if local:
        os.environ[REAPER_TAG_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        reaper = start_reaper(os.environ[REAPER_TAG_ENV])
    init_kwargs: dict[str, Any] = dict(namespace=namespace, log_to_driver=log_to_driver, include_dashboard=False)
    if local:
        init_kwargs.update(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=int(object_store_memory_gb * 1024**3),
            resources=resources,
        )
    else:
        init_kwargs.pop("include_dashboard")

    def restore_env_and_release_reaper() -> None:
        """Undo what this function set above (on exit, or when ray.init fails)."""
        if local and auth_env_before is None:
            os.environ.pop(AUTH_MODE_ENV, None)
        if local and connect_env_before is None:
            os.environ.pop(LOCAL_GCS_CONNECT_ENV, None)
        _restore_env(REAPER_TAG_ENV, tag_before, local)
        _release(reaper)

    try:
        # "local": a new cluster even when RAY_ADDRESS or Ray's record of the last `ray start` on this
        # machine (/tmp/ray/ray_current_cluster, left behind when that cluster is gone) names another.
        context = ray.init(address="local" if local else address, **init_kwargs)
    except BaseException:
        restore_env_and_release_reaper()
        raise

    def cleanup() -> None:
        shutdown_registered()
        if ray.is_initialized():
            ray.shutdown()

    atexit.register(cleanup)
    sigterm: list[int] = []  # the signal number, once SIGTERM arrived inside the block
    installed, previous_sigterm = _install_sigterm_handler(sigterm)
    try:
        nodes = wait_for_alive_nodes(wait_for_nodes, wait_timeout_s)
        yield ClusterInfo(
            address=context.address_info.get("gcs_address", address or ""),
            local=local,
            num_nodes=nodes,
            resources=dict(ray.cluster_resources()),
            sigterm=sigterm,
        )
    except KeyboardInterrupt:
        if sigterm:  # the handler's interrupt (below): the caller sees the signal
            raise StoppedBySignal(sigterm[0]) from None
        raise
    finally:
        if installed:  # a second SIGTERM must not cut the cleanup short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cleanup()
        atexit.unregister(cleanup)
        if installed:
            # None means a handler set outside Python: the closest we can restore is the default.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_sigterm is None else previous_sigterm)
        restore_env_and_release_reaper()


def _restore_env(key: str, before: str | None, changed: bool) -> None:
    if not changed:
        return
    if before is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = before


def _release(reaper: subprocess.Popen | None) -> None:
    """Let the reaper sweep (nothing is left after a shutdown) and exit; not waited for."""
    if reaper is not None and reaper.stdin is not None:
        reaper.stdin.close()


class StoppedBySignal(SystemExit):
    """SIGTERM inside `start_or_connect` outside `stop_on_signal` (e.g. while the workers start): the
    process leaves the block at once, with exit status 128 + the signal unless the caller decides
    otherwise (`megarl train` exits `EXIT_STOPPED_FOR_RESUME` when nothing of the run was lost)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def _install_sigterm_handler(received: list[int]) -> tuple[bool, Any]:
    """Make SIGTERM leave the `with` block like Ctrl-C does, so that cleanup runs; its number goes to
    `received`. Main thread only.

    The handler raises KeyboardInterrupt, as Ctrl-C does, because it may run inside a blocking Ray
    call (`ray.get` while the workers start): Ray turns a KeyboardInterrupt raised there into a
    KeyboardInterrupt in the caller, but any other exception, SystemExit included, into the
    driver's immediate exit with status 1, without cleanup or a word. `start_or_connect` turns it
    back into `StoppedBySignal`."""
    if threading.current_thread() is not threading.main_thread():
        return False, None

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if not received:
            received.append(signum)
        raise KeyboardInterrupt

    return True, signal.signal(signal.SIGTERM, on_sigterm)


class StopRequest:
    """A stop asked for by a signal, read where stopping loses nothing (`stop_on_signal`)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received; None while no stop is asked for
        self.received = 0  # signals received, the first included

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"

    def note(self, signum: int) -> None:
        """Record `signum` (the signal handler's whole work: it only sets data). The first says at
        once, on the file descriptor (a signal handler must not re-enter a buffered stream that the
        interrupted code may be writing), that the stop is under way; later ones are ignored."""
        self.received += 1
        if self.signum is None:
            self.signum = signum
            message = (f"megarl: received {signal.Signals(signum).name}: stopping at the next step boundary "
                       "(the current step finishes, then a checkpoint of it is written); further signals are "
                       "ignored until then, SIGINT or SIGKILL stop at once\n")
        else:
            message = (f"megarl: received {signal.Signals(signum).name} again: ignored, the stop asked for "
                       "earlier is under way (a checkpoint being written is not interrupted)\n")
        try:
            os.write(2, message.encode())
        except OSError:  # stderr closed: the stop still happens
            pass


@contextmanager
def stop_on_signal(signals: tuple[int, ...] = (signal.SIGTERM,), pending: Sequence[int] = ()) -> Iterator[StopRequest]:
    """Inside the block, `signals` (SIGTERM: SLURM before the time limit, Kubernetes, `kill`) set
    `StopRequest.requested` instead of stopping the process; the caller polls it where stopping
    keeps its work. A repeated signal never interrupts anything, so a checkpoint being written when
    it arrives is finished. SIGINT (Ctrl-C) and SIGKILL still stop at once.

    On leaving the block the earlier handlers come back, unless a stop was asked for: then the
    signals stay noted-and-ignored, so that a late one cannot change the exit status of the
    shutdown that follows. Outside the main thread (no signal handlers there) the request is never
    set. `pending`: signals received before the block (`ClusterInfo.sigterm`), taken as received in it.
    """
    request = StopRequest()
    for signum in pending[:1]:
        request.note(signum)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        request.note(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in signals}
    try:
        yield request
    finally:
        if not request.requested:
            for signum, handler in previous.items():
                # None means a handler set outside Python: the closest we can restore is the default.
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def wait_for_alive_nodes(count: int, timeout_s: float) -> int:
    """Block until at least `count` Ray nodes are alive; return how many are. ClusterError on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = sum(1 for node in ray.nodes() if node["Alive"])
        if alive >= count:
            return alive
        if time.monotonic() > deadline:
            raise ClusterError(
                f"waited {timeout_s} s for {count} Ray nodes, {alive} alive:\n{describe_cluster()}"
            )
        time.sleep(0.2)


def describe_cluster() -> str:
    """One line per alive node: IP, node id prefix, total and available resources (Ray's view).

    Internal bookkeeping resources (placement-group shadows, node markers, memory) are left out.
    """
    lines = []
    available_by_node = _available_by_node()
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        node_id = node["NodeID"]
        total = _user_resources(node["Resources"])
        available = _user_resources(available_by_node.get(node_id, {}))
        lines.append(
            f"node {node['NodeManagerAddress']} ({node_id[:8]}): total {_fmt(total)}, available {_fmt(available)}"
        )
    if not lines:
        return "(no alive Ray nodes)"
    lines.append(f"cluster: total {_fmt(_user_resources(ray.cluster_resources()))}, "
                 f"available {_fmt(_user_resources(ray.available_resources()))}")
    return "\n".join(lines)


def _available_by_node() -> dict[str, dict[str, float]]:
    """Available resources per node id, from Ray's state API (best effort: empty if unavailable)."""
    try:
        from ray._private.state import available_resources_per_node

        return {node_id: dict(res) for node_id, res in available_resources_per_node().items()}
    except Exception:  # a private API: degrade to totals only
        return {}


def _user_resources(resources: dict[str, float]) -> dict[str, float]:
    """Resources a user asks for: CPU, GPU, custom ones; not placement-group or node bookkeeping."""
    return {
        name: amount
        for name, amount in sorted(resources.items())
        if "_group_" not in name
        and not name.startswith("node:")
        and name not in ("memory", "object_store_memory")
    }


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"
