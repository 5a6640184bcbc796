"""A multi-node Ray cluster on one machine: a head and worker nodes started with `ray start`.

This is how the launch scripts bring a cluster up (one `ray start --head`, then `ray start
--address=...` per node), run on one machine so that tests exercise a real multi-node cluster:
separate raylets, object stores and node ids, each node with its own resources.

    with LocalRayNodes([{"node_a": 1}, {"node_b": 1}], cpus_per_node=1) as nodes:
        with start_or_connect(nodes.address, wait_for_nodes=2):
            ...

Each node is a `ray start --block` child process in its own session; on exit they are sent
SIGTERM (worker nodes first), which makes `ray start` stop the processes it started, and any
that survive are killed by process id. `ray stop` is deliberately not used: it stops every Ray
process of the machine, including clusters that are not ours.

Notes measured with Ray 2.60: every node needs its own dashboard-agent and metrics ports (they are
fixed by default, and a second node on the same ports crashes its raylet); Ray replaces a loopback
`--node-ip-address` by the machine's own address, so the nodes report that IP.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psutil

from megarl.cluster.ray_cluster import ClusterError
from megarl.cluster.rendezvous import free_port


class LocalRayNodes:
    """Start len(node_resources) Ray nodes on this machine (the first is the head)."""

    def __init__(
        self,
        node_resources: list[dict[str, float]],
        cpus_per_node: int = 1,
        object_store_mb: int = 100,
        start_timeout_s: float = 60.0,
        log_dir: str | os.PathLike[str] | None = None,
        keep_temp_dir: bool = False,
    ) -> None:
        if not node_resources:
            raise ValueError("LocalRayNodes needs at least one node")
        self.node_resources = node_resources
        self.cpus_per_node = cpus_per_node
        self.object_store_mb = object_store_mb
        self.start_timeout_s = start_timeout_s
        self.keep_temp_dir = keep_temp_dir
        # Short path: Ray's Unix socket paths under the temp dir must stay under ~107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="megarl_ray_", dir="/tmp")
        self.log_dir = Path(log_dir) if log_dir is not None else Path(self.temp_dir)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._processes: list[subprocess.Popen[bytes]] = []
        self._environment = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}

    def _node_args(self, resources: dict[str, float]) -> list[str]:
        return [
            f"--num-cpus={self.cpus_per_node}",
            f"--object-store-memory={self.object_store_mb * 1024 * 1024}",
            "--node-ip-address=127.0.0.1",
            f"--resources={json.dumps(resources)}",
            # Every port a second raylet on this machine would otherwise share (fixed defaults).
            *(f"--{name}={free_port()}" for name in (
                "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")),
            # Worker processes bind OS-chosen ports instead of Ray's shared default range.
            "--min-worker-port=0",
            "--max-worker-port=0",
            "--block",
        ]

    def _spawn(self, args: list[str], log_name: str) -> None:
        ray_cli = str(Path(sys.executable).with_name("ray"))
        with open(self.log_dir / log_name, "wb") as log:
            process = subprocess.Popen(
                [ray_cli, "start", *args], stdout=log, stderr=subprocess.STDOUT,
                env=self._environment, start_new_session=True,
            )
        self._processes.append(process)

    def __enter__(self) -> LocalRayNodes:
        try:
            head, *workers = self.node_resources
            self._spawn(
                ["--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp_dir}",
                 f"--ray-client-server-port={free_port()}", *self._node_args(head)],
                "head.log",
            )
            self._wait_for_port()
            for index, resources in enumerate(workers, start=1):
                self._spawn([f"--address={self.address}", *self._node_args(resources)], f"node{index}.log")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_port(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._processes[0].poll() is not None:
                code = self._processes[0].returncode
                raise ClusterError(f"ray head exited with code {code}; see {self.log_dir / 'head.log'}")
            with socket.socket() as probe:
                probe.settimeout(0.5)
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise ClusterError(f"ray head did not listen on port {self.port} within {self.start_timeout_s} s")

    def stop(self, timeout_s: float = 45.0) -> None:
        """Stop the worker nodes, then the head; kill by pid whatever is still running."""
        children: list[psutil.Process] = []
        for process in reversed(self._processes):
            try:
                children.extend(psutil.Process(process.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in reversed(self._processes):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        _, alive = psutil.wait_procs(children, timeout=5)
        for child in alive:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self._processes = []
        if not self.keep_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
