"""The SLURM bootstrap for real: two Ray nodes on loopback, described by a fake two-node allocation.

Each "node" is a ``bootstrap.py`` process with the SLURM variables a real srun task would see
(SLURM_JOB_NODELIST=node[01-02], SLURM_NODEID=0/1). MEGARL_NODE_IPS maps both hosts to 127.0.0.1 and
MEGARL_RAY_START_ARGS gives each raylet its own free ports, which is what lets two raylets share one
machine. Most tests run ``standin_train.py`` through the trainer's entrypoint and argument path (it
places one task on each node and can hold or fail on demand); the last one runs the real
`megarl train` on a tiny GRPO job with one tensor-parallel rank on each node.

Ray token authentication is on, as on a real cluster (the token reaches both nodes by environment).
Time bounds are generous: on a loaded 2-core machine one `ray start` alone can take 40 s.
Teardown never uses ``ray stop``: other tests may run Ray clusters on this machine at the same time.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
BOOTSTRAP = REPO / "launch" / "slurm" / "bootstrap.py"
STANDIN = Path(__file__).with_name("standin_train.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raylet_ports(head: bool) -> str:
    """Ports one raylet would otherwise share with a second raylet on this machine (fixed defaults)."""
    names = [
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
    ]
    if head:
        names.append("ray-client-server-port")
    # 0/0: workers bind OS-chosen ports instead of Ray's shared default range.
    return " ".join(f"--{n}={free_port()}" for n in names) + " --min-worker-port=0 --max-worker-port=0"


class FakeAllocation:
    """Two bootstrap processes for a fake two-node SLURM job, and everything needed to clean up after them."""

    def __init__(
        self, workdir: Path, ray_temp: Path, wait_timeout_s: float = 180.0, hold_s: float = 0.0, nodes: int = 2
    ) -> None:
        self.workdir = workdir
        self.ray_temp = ray_temp
        self.port = free_port()
        self.out = workdir / "standin.json"
        self.procs: dict[int, subprocess.Popen] = {}
        python_bin = str(Path(sys.executable).parent)
        self.base_env = {
            **os.environ,
            "PATH": python_bin + os.pathsep + os.environ.get("PATH", ""),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": f"node[01-{nodes:02d}]",
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_CPUS_ON_NODE": "1",
            "MEGARL_NODE_IPS": ",".join(["127.0.0.1"] * nodes),
            "MEGARL_RAY_PORT": str(self.port),
            "MEGARL_RAY_DASHBOARD": "0",
            "MEGARL_OBJECT_STORE_BYTES": str(80 * 2**20),
            "MEGARL_RAY_TEMP_DIR": str(ray_temp),
            "MEGARL_WAIT_TIMEOUT": str(wait_timeout_s),
            "MEGARL_HEAD_GRACE": "2",
            "MEGARL_ENTRYPOINT": f"{sys.executable} {STANDIN}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "STANDIN_OUT": str(self.out),
            "STANDIN_HOLD_S": str(hold_s),
            "OMP_NUM_THREADS": "1",
        }
        # Node 0 reads the config's resource pools before Ray starts: the stand-in runs get a minimal one
        # (an actor pool only, which the launcher spreads over every node).
        config = workdir / "experiment.yaml"
        if not config.exists():
            config.write_text("resources:\n  device: cpu\n  actor_pool: {nnodes: 1, devices_per_node: 1}\n")
        self.base_env.pop("SLURM_GPUS_ON_NODE", None)
        self.base_env.pop("SLURM_GPUS_PER_NODE", None)
        self.base_env.pop("RAY_ADDRESS", None)

    def start(self, rank: int, *args: str) -> subprocess.Popen:
        env = {**self.base_env, "SLURM_NODEID": str(rank), "SLURM_PROCID": str(rank)}
        env["MEGARL_RAY_START_ARGS"] = raylet_ports(head=rank == 0)
        log = open(self.workdir / f"node{rank}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, str(BOOTSTRAP), *args],
            env=env,
            cwd=self.workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: the cleanup below can reach every descendant
        )
        log.close()
        self.procs[rank] = proc
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- node{r}.log ---\n" + (self.workdir / f"node{r}.log").read_text() for r in self.procs)

    def leftovers(self) -> list[psutil.Process]:
        """Processes whose command line names this test's Ray temp dir (gcs_server, raylet, workers ...)."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if any(str(self.ray_temp) in part for part in proc.info["cmdline"] or []):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def kill_everything(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        for proc in self.leftovers():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture
def workdir() -> Iterator[tuple[Path, Path]]:
    # Short paths: Ray puts unix sockets under its temp dir, and those are limited to ~107 bytes.
    root = Path(tempfile.mkdtemp(prefix="mrl"))
    try:
        yield root, root / "ray"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for proc in procs:
        codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
    return codes


def assert_torn_down(alloc: FakeAllocation) -> None:
    deadline = time.monotonic() + 20
    while alloc.leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(p.pid, " ".join(p.cmdline()[:2])) for p in alloc.leftovers() if p.is_running()]
    assert not left, f"Ray processes left running after teardown: {left}\n{alloc.logs()}"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", alloc.port)) != 0, "the head's GCS port still accepts connections"


def test_two_nodes_on_loopback_run_the_job_across_both_and_tear_down(workdir: tuple[Path, Path]) -> None:
    root, ray_temp = workdir
    alloc = FakeAllocation(root, ray_temp)
    try:
        worker = alloc.start(1, "experiment.yaml", "rollout.n=2")
        head = alloc.start(0, "experiment.yaml", "rollout.n=2")
        try:
            head_code, worker_code = wait_all([head, worker], timeout_s=300)
        except subprocess.TimeoutExpired:
            pytest.fail("the bootstrap did not finish within 300 s\n" + alloc.logs())
        assert head_code == 0, alloc.logs()
        assert worker_code == 0, alloc.logs()

        report = json.loads(alloc.out.read_text())
        head_address = f"127.0.0.1:{alloc.port}"
        assert report["config"] == "experiment.yaml"
        # Derived overrides first, the user's last (so the user's win).
        assert report["overrides"] == [
            f"resources.ray_address={head_address}",
            "resources.actor_pool.nnodes=2",
            "rollout.n=2",
        ]
        assert report["ray_address_env"] == head_address
        assert len(report["alive_nodes"]) == 2
        # One task pinned to each node ran there: the job really spans both raylets.
        assert sorted(report["ran_on"]) == report["alive_nodes"]
        assert_torn_down(alloc)
    finally:
        alloc.kill_everything()


def test_scancel_sigterm_stops_trainer_and_both_nodes(workdir: tuple[Path, Path]) -> None:
    root, ray_temp = workdir
    alloc = FakeAllocation(root, ray_temp, hold_s=120)
    try:
        worker = alloc.start(1, "experiment.yaml")
        head = alloc.start(0, "experiment.yaml")
        deadline = time.monotonic() + 240
        while not alloc.out.exists():  # the stand-in has run its tasks and now holds the job open
            assert head.poll() is None, "head exited early\n" + alloc.logs()
            assert time.monotonic() < deadline, "the job never started\n" + alloc.logs()
            time.sleep(0.5)
        # scancel signals every task of the step; here: both nodes' bootstrap processes.
        head.send_signal(signal.SIGTERM)
        worker.send_signal(signal.SIGTERM)
        head_code, worker_code = wait_all([head, worker], timeout_s=120)
        assert head_code == 128 + signal.SIGTERM, alloc.logs()
        assert worker_code == 128 + signal.SIGTERM, alloc.logs()
        stand_ins = [p for p in psutil.process_iter(["cmdline"]) if str(STANDIN) in " ".join(p.info["cmdline"] or [])]
        assert not [p for p in stand_ins if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert_torn_down(alloc)
    finally:
        alloc.kill_everything()


def test_missing_node_times_out_with_a_clear_error(workdir: tuple[Path, Path]) -> None:
    root, ray_temp = workdir
    alloc = FakeAllocation(root, ray_temp, wait_timeout_s=6)  # counted from when the head is up
    try:
        head = alloc.start(0, "experiment.yaml")  # node 1 never starts
        code = wait_all([head], timeout_s=240)[0]
        assert code == 1, alloc.logs()
        assert "only 1 of 2 Ray nodes joined" in alloc.logs()
        assert not alloc.out.exists(), "the trainer must not start on a partial cluster"
        assert_torn_down(alloc)
    finally:
        alloc.kill_everything()


def test_failed_trainer_status_is_the_job_status_single_node(workdir: tuple[Path, Path]) -> None:
    root, ray_temp = workdir
    alloc = FakeAllocation(root, ray_temp, nodes=1)
    alloc.base_env["STANDIN_EXIT"] = "3"
    try:
        head = alloc.start(0, "experiment.yaml")
        code = wait_all([head], timeout_s=240)[0]
        assert code == 3, alloc.logs()
        report = json.loads(alloc.out.read_text())
        assert report["overrides"] == [f"resources.ray_address=127.0.0.1:{alloc.port}", "resources.actor_pool.nnodes=1"]
        assert len(report["ran_on"]) == 1
        assert_torn_down(alloc)
    finally:
        alloc.kill_everything()


def write_experiment(root: Path, train_size: int, actor: dict, trainer: dict) -> Path:
    """`root/experiment.yaml`: tiny GRPO on CPU over a fresh arithmetic task in `root/data`, with `actor`
    and `trainer` keys added to the defaults below."""
    import yaml

    data = root / "data"
    subprocess.run(
        [sys.executable, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(data), "--tokenizer-out",
         str(data / "tok"), "--num-operands", "2", "--min-value", "0", "--max-value", "4", "--operators", "+",
         "--train-size", str(train_size), "--val-size", "8"],
        check=True, capture_output=True,
    )
    config = {
        "data": {"train_files": [str(data / "train.parquet")], "tokenizer": str(data / "tok"), "max_prompt_length": 8,
                 "max_response_length": 4, "train_batch_size": 2, "apply_chat_template": "false"},
        "model": {"init_from_scratch": True, "hf_config": {
            "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}},
        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4, **actor},
        "rollout": {"engine": "hf", "n": 2},
        "trainer": {"val_before_train": False, "progress_bar": False, **trainer},
        "resources": {"device": "cpu", "actor_pool": {"nnodes": 1, "devices_per_node": 1}},
        "tracking": {"backends": ["jsonl"], "report_plots": False},
    }
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_trainer_runs_a_tiny_job_across_both_nodes(workdir: tuple[Path, Path]) -> None:
    """The real `megarl train` through the SLURM bootstrap: TP=2 with one rank on each node."""
    root, ray_temp = workdir
    write_experiment(root, train_size=64, actor={"megatron": {"tensor_model_parallel_size": 2}},
                     trainer={"total_training_steps": 1, "default_local_dir": str(root / "run")})
    alloc = FakeAllocation(root, ray_temp)
    alloc.base_env["MEGARL_ENTRYPOINT"] = f"{sys.executable} -m megarl.cli train"
    try:
        worker = alloc.start(1, "experiment.yaml")
        head = alloc.start(0, "experiment.yaml")
        try:
            head_code, worker_code = wait_all([head, worker], timeout_s=500)
        except subprocess.TimeoutExpired:
            pytest.fail("the training job did not finish within 500 s\n" + alloc.logs())
        assert head_code == 0, alloc.logs()
        assert worker_code == 0, alloc.logs()
        lines = (root / "run" / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in lines]
        assert 1 in steps, alloc.logs()
        assert "resources.actor_pool.nnodes=2" in alloc.logs()
        assert_torn_down(alloc)
    finally:
        alloc.kill_everything()
