"""What each node of a SLURM allocation runs: the ``ray start`` command, its environment, and (on node 0)
the wait for the cluster and the ``megarl train`` command with the overrides the allocation implies.

Pure: nothing here starts a process, so ``bootstrap.py --dry-run`` prints exactly what a real run
executes (but for another node's MEGARL_NET_IFACE address, which only that node can read: shown as
``<IFACE address on HOST>``), and tests check the commands without SLURM or Ray. Node 0's plan reads
the experiment config (``pool_nodes``): every resource pool takes whole nodes of its own, the pools
other than the actor's keep the nnodes the config gives them and the actor's pool gets the rest of
the allocation; a config whose pools do not add up to the allocation is refused before Ray starts.
"""

from __future__ import annotations

import fcntl
import shlex
import socket
import struct
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from slurm_env import Allocation, LaunchError

DEFAULT_RAY_PORT = 6379
DEFAULT_WAIT_TIMEOUT_S = 300.0
DEFAULT_ENTRYPOINT = "megarl train"
DEFAULT_STOP_TIMEOUT_S = 240.0  # of the 300 s that megarl.sbatch's --signal=B:TERM@300 leaves
# The experiment config's resource pools (resources.<key>), the actor's first. A pool that is null
# (the default for all but the actor's) shares the actor's processes and takes no node of its own.
POOL_KEYS = ("actor_pool", "critic_pool", "ref_pool", "reward_model_pool", "rollout_pool")


@dataclass(frozen=True)
class LaunchSettings:
    """Knobs of a multi-node launch; every one is an environment variable (see ``from_env``)."""

    ray_port: int = DEFAULT_RAY_PORT  # MEGARL_RAY_PORT: GCS port of the head
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S  # MEGARL_WAIT_TIMEOUT: other nodes must join by then
    head_start_timeout_s: float = 180.0  # MEGARL_HEAD_START_TIMEOUT: the head's GCS must be up by then
    entrypoint: str = DEFAULT_ENTRYPOINT  # MEGARL_ENTRYPOINT: the trainer command (CONFIG and overrides follow)
    node_ips: tuple[str, ...] = ()  # MEGARL_NODE_IPS: comma list, one per node (skips hostname lookup)
    net_iface: Optional[str] = None  # MEGARL_NET_IFACE: NIC for NCCL/gloo and the worker nodes' Ray address
    checkpoint_dir: Optional[str] = None  # MEGARL_CKPT_DIR: trainer.default_local_dir, on the shared filesystem
    dashboard: bool = True  # MEGARL_RAY_DASHBOARD=0 turns the Ray dashboard off
    object_store_bytes: Optional[int] = None  # MEGARL_OBJECT_STORE_BYTES: per-node object store size
    temp_dir: Optional[str] = None  # MEGARL_RAY_TEMP_DIR: Ray's session/log directory on each node
    extra_ray_args: tuple[str, ...] = ()  # MEGARL_RAY_START_ARGS: more `ray start` flags for this node
    head_grace_s: float = 10.0  # MEGARL_HEAD_GRACE: workers stop this long after the head went away
    ray_stop_all: bool = False  # MEGARL_RAY_STOP_ALL=1: also `ray stop --force` at teardown (exclusive nodes)
    # MEGARL_STOP_TIMEOUT: after SIGTERM, how long the trainer gets to finish its step and write a checkpoint
    # before it is killed; with --signal=B:TERM@300 it must leave time for the Ray teardown after it.
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    # MEGARL_JOB_STATE_DIR (set by megarl.sbatch, on node 0's host): node 0 leaves its pid there (`bootstrap.pid`,
    # so that the batch script can ask it alone to stop) and the trainer's exit status (`trainer.status`).
    state_dir: Optional[str] = None

    @staticmethod
    def from_env(env: Mapping[str, str]) -> "LaunchSettings":
        def number(name: str, default: float) -> float:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = float(raw)
            except ValueError:
                raise LaunchError(f"{name}='{raw}' is not a number") from None
            if value <= 0:
                raise LaunchError(f"{name}='{raw}' must be positive")
            return value

        def flag(name: str, default: bool) -> bool:
            raw = env.get(name, "").strip().lower()
            if not raw:
                return default
            if raw not in ("0", "1", "true", "false", "yes", "no"):
                raise LaunchError(f"{name}='{raw}' must be 0/1 (or true/false)")
            return raw in ("1", "true", "yes")

        port = int(number("MEGARL_RAY_PORT", DEFAULT_RAY_PORT))
        if not 1 <= port <= 65535:
            raise LaunchError(f"MEGARL_RAY_PORT={port} is not a TCP port (1..65535)")
        ips = tuple(ip.strip() for ip in env.get("MEGARL_NODE_IPS", "").split(",") if ip.strip())
        store = env.get("MEGARL_OBJECT_STORE_BYTES", "").strip()
        return LaunchSettings(
            ray_port=port,
            wait_timeout_s=number("MEGARL_WAIT_TIMEOUT", DEFAULT_WAIT_TIMEOUT_S),
            head_start_timeout_s=number("MEGARL_HEAD_START_TIMEOUT", 180.0),
            entrypoint=env.get("MEGARL_ENTRYPOINT", "").strip() or DEFAULT_ENTRYPOINT,
            node_ips=ips,
            net_iface=env.get("MEGARL_NET_IFACE", "").strip() or None,
            checkpoint_dir=env.get("MEGARL_CKPT_DIR", "").strip() or None,
            dashboard=flag("MEGARL_RAY_DASHBOARD", True),
            object_store_bytes=int(number("MEGARL_OBJECT_STORE_BYTES", 1)) if store else None,
            temp_dir=env.get("MEGARL_RAY_TEMP_DIR", "").strip() or None,
            extra_ray_args=tuple(shlex.split(env.get("MEGARL_RAY_START_ARGS", ""))),
            head_grace_s=number("MEGARL_HEAD_GRACE", 10.0),
            ray_stop_all=flag("MEGARL_RAY_STOP_ALL", False),
            stop_timeout_s=number("MEGARL_STOP_TIMEOUT", DEFAULT_STOP_TIMEOUT_S),
            state_dir=env.get("MEGARL_JOB_STATE_DIR", "").strip() or None,
        )


@dataclass(frozen=True)
class NodePlan:
    """The commands one node runs. ``driver`` is set on the head only."""

    rank: int
    host: str
    is_head: bool
    head_address: str  # HOST_OR_IP:PORT of the head's GCS
    ray_start: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set for `ray start` and the driver
    expected_nodes: int = 1
    driver: Optional[list[str]] = None
    pools: dict[str, int] = field(default_factory=dict)  # head only: nodes of each resource pool (pool_nodes)


def interface_ip(iface: str) -> str:
    """IPv4 address of a local network interface (Linux SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))
        except OSError as err:
            raise LaunchError(f"MEGARL_NET_IFACE={iface}: no IPv4 address on this node ({err})") from None
    return socket.inet_ntoa(packed[20:24])


def resolve_head_ip(alloc: Allocation, settings: LaunchSettings) -> str:
    """The address every node uses to reach the head: MEGARL_NODE_IPS[0], else the head hostname's IP."""
    if settings.node_ips:
        return settings.node_ips[0]
    try:
        ip = socket.gethostbyname(alloc.hosts[0])
    except OSError as err:
        raise LaunchError(
            f"cannot resolve the head node '{alloc.hosts[0]}' ({err}); set MEGARL_NODE_IPS=ip0,ip1,... "
            "(one per node, allocation order)"
        ) from None
    if ip.startswith("127.") and alloc.num_nodes > 1:
        # Common with Debian-style /etc/hosts; the other nodes could never reach it.
        raise LaunchError(
            f"the head node '{alloc.hosts[0]}' resolves to the loopback address {ip}, which other nodes cannot "
            "reach; set MEGARL_NODE_IPS=ip0,ip1,... (one per node, allocation order)"
        )
    return ip


def own_ip(alloc: Allocation, settings: LaunchSettings, rank: int, head_ip: str) -> Optional[str]:
    """Node `rank`'s Ray address. MEGARL_NODE_IPS: its entry. The head: the address every node
    reaches it at (`resolve_head_ip`), so that what it registers and the other nodes' --address
    agree. Another node with MEGARL_NET_IFACE: that interface's address, which only the node itself
    can read: a dry run planning the other nodes shows it as `<IFACE address on HOST>`. Otherwise
    None: Ray picks."""
    if settings.node_ips:
        return settings.node_ips[rank]
    if rank == 0:
        return head_ip
    if settings.net_iface:
        if rank == alloc.node_rank:
            return interface_ip(settings.net_iface)
        return f"<{settings.net_iface} address on {alloc.hosts[rank]}>"
    return None


def config_pool_nodes(config: str, overrides: Sequence[str]) -> dict[str, int]:
    """nnodes of every resource pool that ``config`` with ``overrides`` sets (``resources.*_pool``, null ones
    left out), read as ``megarl train`` reads them, the actor's first.

    Imports megarl.config (yaml and omegaconf, no torch or Ray) only when called: node 0 and the dry run
    need it, the other nodes never read the config.
    """
    try:
        from megarl.config import load_config
        from megarl.errors import ConfigError
    except ImportError as err:
        import sys

        raise LaunchError(
            f"cannot read the resource pools of {config}: this Python ({sys.executable}) has no megarl ({err}); "
            "set MEGARL_PYTHON to the Python of the megarl environment"
        ) from None
    try:
        cfg = load_config(config, list(overrides), validate=False)  # the trainer validates the rest
    except ConfigError as err:
        raise LaunchError(f"cannot read the resource pools of {config}: {err}") from None
    res = cfg.resources
    return {key: int(res[key].nnodes) for key in POOL_KEYS if res.get(key) is not None}


def describe_pools(pools: Mapping[str, int]) -> str:
    """``actor_pool 1 + critic_pool 1 = 2``"""
    terms = " + ".join(f"{key} {n}" for key, n in pools.items())
    return f"{terms} = {sum(pools.values())}" if len(pools) > 1 else terms


def pool_nodes(alloc: Allocation, config: str, overrides: Sequence[str]) -> dict[str, int]:
    """Nodes of each resource pool of the run on this allocation, the actor's first.

    Every pool takes whole nodes of its own: the pools other than the actor's keep the nnodes the config
    (with the user's overrides) gives them; the actor's pool gets the nodes they leave, and that is the
    ``resources.actor_pool.nnodes`` the launcher passes. LaunchError, naming the pools, their nodes and
    the allocation's, when they leave the actor pool no node, or when the user's own overrides (which
    come after the launcher's and win) make the pools' total differ from the allocation's nodes.
    """
    n = alloc.num_nodes
    configured = config_pool_nodes(config, overrides)
    others = {key: nodes for key, nodes in configured.items() if key != "actor_pool"}
    taken = sum(others.values())
    actor = n - taken
    if actor < 1:
        raise LaunchError(
            f"the resource pools of {config} need more than the allocation's {n} node(s): "
            f"{describe_pools(others)} node(s) (resources.*_pool.nnodes) plus at least 1 for actor_pool, which "
            f"gets the nodes the other pools leave; submit with sbatch --nodes={taken + 1} (or more), or give "
            "those pools fewer nodes"
        )
    # What the trainer will read: the launcher's actor nnodes, then the user's overrides (which win).
    final = config_pool_nodes(config, [f"resources.actor_pool.nnodes={actor}", *overrides])
    total = sum(final.values())
    if total != n:
        raise LaunchError(
            f"the resource pools of {config} take {describe_pools(final)} node(s) (resources.*_pool.nnodes, with "
            f"your overrides) but the allocation has {n}; submit with sbatch --nodes={total}, or leave "
            f"resources.actor_pool.nnodes to the launcher (it gives the actor pool the {actor} node(s) the other "
            "pools leave)"
        )
    return final


def derived_overrides(
    alloc: Allocation, settings: LaunchSettings, head_address: str, pools: Mapping[str, int]
) -> list[str]:
    """Config overrides that follow from the allocation; the user's own overrides come after and win.

    ``pools``: nodes of each resource pool (``pool_nodes``). The actor pool's nnodes is its entry; with
    GPUs allocated, every pool's devices_per_node is the GPUs per node (each pool has whole nodes).
    """
    overrides = [
        f"resources.ray_address={head_address}",
        f"resources.actor_pool.nnodes={pools['actor_pool']}",
    ]
    if alloc.gpus_per_node > 0:
        keys = ["actor_pool"] + [key for key in pools if key != "actor_pool"]
        overrides += [f"resources.{key}.devices_per_node={alloc.gpus_per_node}" for key in keys]
        overrides.append("resources.device=cuda")
    if settings.checkpoint_dir:
        overrides.append(f"trainer.default_local_dir={settings.checkpoint_dir}")
    return overrides


def plan_node(
    alloc: Allocation,
    settings: LaunchSettings,
    rank: int,
    config: str,
    overrides: list[str],
    head_ip: str,
    pools: Optional[Mapping[str, int]] = None,
) -> NodePlan:
    """The commands of node ``rank`` (0 = head + driver).

    ``pools``: nodes of each resource pool; None on node 0 reads them from the config (``pool_nodes``,
    which refuses pools that do not fit the allocation). The other nodes do not need them.
    """
    if settings.node_ips and len(settings.node_ips) != alloc.num_nodes:
        raise LaunchError(
            f"MEGARL_NODE_IPS has {len(settings.node_ips)} addresses but the allocation has {alloc.num_nodes} "
            f"nodes ({', '.join(alloc.hosts)})"
        )
    head_address = f"{head_ip}:{settings.ray_port}"
    cmd = ["ray", "start", "--block", "--disable-usage-stats"]
    if rank == 0:
        cmd += ["--head", f"--port={settings.ray_port}", f"--include-dashboard={str(settings.dashboard).lower()}"]
    else:
        cmd += [f"--address={head_address}"]
    ip = own_ip(alloc, settings, rank, head_ip)
    if ip:
        cmd.append(f"--node-ip-address={ip}")
    cmd += [f"--num-cpus={alloc.cpus_per_node}", f"--num-gpus={alloc.gpus_per_node}"]
    if settings.object_store_bytes:
        cmd.append(f"--object-store-memory={settings.object_store_bytes}")
    if settings.temp_dir and rank == 0:  # Ray takes the temp dir from the head; workers follow it
        cmd.append(f"--temp-dir={settings.temp_dir}")
    cmd += list(settings.extra_ray_args)

    env: dict[str, str] = {}
    if settings.net_iface:
        # Collectives bind to the fast fabric, not to whatever interface the hostname resolves to.
        env.update(NCCL_SOCKET_IFNAME=settings.net_iface, GLOO_SOCKET_IFNAME=settings.net_iface)
    driver = None
    head_pools: dict[str, int] = {}
    if rank == 0:
        head_pools = dict(pools) if pools is not None else pool_nodes(alloc, config, overrides)
        driver = shlex.split(settings.entrypoint) + [config]
        driver += derived_overrides(alloc, settings, head_address, head_pools)
        driver += overrides
    return NodePlan(
        rank=rank,
        host=alloc.hosts[rank],
        is_head=rank == 0,
        head_address=head_address,
        ray_start=cmd,
        env=env,
        expected_nodes=alloc.num_nodes,
        driver=driver,
        pools=head_pools,
    )


def format_plan(plans: list[NodePlan], settings: LaunchSettings) -> str:
    """Human-readable commands of every node, in the order each node runs them (the dry-run output)."""
    lines = []
    for p in plans:
        role = "head + driver" if p.is_head else "worker"
        lines.append(f"# node {p.rank} ({p.host}, {role})")
        lines.extend(f"export {k}={shlex.quote(v)}" for k, v in sorted(p.env.items()))
        if not p.is_head:
            patience = settings.head_start_timeout_s + settings.wait_timeout_s
            lines.append(f"# wait until {p.head_address} accepts connections (timeout {patience:g} s)")
        lines.append(shlex.join(p.ray_start) + " &")
        if p.is_head and p.driver is not None:
            lines.append(
                f"# wait until the head is up (timeout {settings.head_start_timeout_s:g} s), then until "
                f"{p.expected_nodes} Ray nodes are alive (timeout {settings.wait_timeout_s:g} s)"
            )
            if p.pools:
                lines.append(
                    f"# resource pools, nodes: {describe_pools(p.pools)} (the allocation's {p.expected_nodes}); "
                    "the actor pool gets the nodes the others leave"
                )
            lines.append(f"RAY_ADDRESS={p.head_address} " + shlex.join(p.driver))
            lines.append(f"# on SIGTERM: SIGTERM to the trainer alone, which checkpoints its last step; killed after "
                         f"{settings.stop_timeout_s:g} s (MEGARL_STOP_TIMEOUT)")
            lines.append("# then stop this node's Ray processes; workers stop once the head is gone")
        else:
            lines.append(f"# stop when {p.head_address} is gone for {settings.head_grace_s:g} s")
        if settings.ray_stop_all:
            lines.append("ray stop --force")
        lines.append("")
    return "\n".join(lines)


def plan_cluster(
    alloc: Allocation,
    settings: LaunchSettings,
    config: str,
    overrides: list[str],
    pools: Optional[Mapping[str, int]] = None,
) -> list[NodePlan]:
    """Plans of every node (for the dry run); a real node executes only ``plans[alloc.node_rank]``.
    ``pools``: as for ``plan_node`` (None: read from the config)."""
    head_ip = resolve_head_ip(alloc, settings)
    return [plan_node(alloc, settings, r, config, overrides, head_ip, pools) for r in range(alloc.num_nodes)]
