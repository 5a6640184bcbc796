"""Read a SLURM allocation from the environment of one task: the nodes, this node's rank, its GPUs and CPUs.

Pure functions over strings and an environment mapping (no SLURM needed), so they can be tested on
any machine. The hostnames come from ``scontrol show hostnames`` when it is available and from
:func:`expand_nodelist` otherwise; both understand SLURM's compressed form (``node[01-03,07]``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional


class LaunchError(RuntimeError):
    """The allocation or the launch settings are unusable; the message names the variable and what is valid."""


# One bracketed range list, e.g. "[01-03,07]"; SLURM allows several per name ("rack[1-2]-n[1-4]").
_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(nodelist: str) -> list[str]:
    """Split at commas that are not inside brackets: "a[1-2,4],b" -> ["a[1-2,4]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise LaunchError(f"nodelist '{nodelist}': nested '[' at column {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"nodelist '{nodelist}': unmatched ']' at column {i}")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchError(f"nodelist '{nodelist}': unclosed '['")
    parts.append(nodelist[start:])
    return parts


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    """"01-03,07" -> ["01", "02", "03", "07"], keeping the zero padding of the lower bound."""
    out: list[str] = []
    for item in ranges.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchError(f"nodelist '{nodelist}': bad range '{item}' (want N or N-M with digits)")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise LaunchError(f"nodelist '{nodelist}': range '{item}' runs backwards")
        width = len(lo)
        out.extend(str(k).zfill(width) for k in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed hostlist, e.g. ``"gpu[01-03,07],login1"`` -> gpu01 gpu02 gpu03 gpu07 login1.

    Several bracket groups in one name expand as a product, leftmost slowest, as SLURM does:
    ``"r[1-2]-n[1-2]"`` -> r1-n1 r1-n2 r2-n1 r2-n2.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise LaunchError("nodelist is empty (SLURM_JOB_NODELIST unset or blank?)")
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        if not part:
            raise LaunchError(f"nodelist '{nodelist}': empty entry between commas")
        names = [""]
        pos = 0
        for match in _BRACKET.finditer(part):
            prefix = part[pos : match.start()]
            names = [n + prefix + r for n in names for r in _expand_ranges(match.group(1), nodelist)]
            pos = match.end()
        names = [n + part[pos:] for n in names]
        hosts.extend(names)
    return hosts


def hostnames(nodelist: str, use_scontrol: bool = True) -> list[str]:
    """The hosts of ``nodelist`` in allocation order: ``scontrol show hostnames`` if present, else the parser."""
    scontrol = shutil.which("scontrol") if use_scontrol else None
    if scontrol:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.split()
    return expand_nodelist(nodelist)


def expand_counts(value: str) -> list[int]:
    """SLURM's per-node count lists: ``"72(x2),36"`` -> [72, 72, 36] (SLURM_JOB_CPUS_PER_NODE)."""
    out: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise LaunchError(f"per-node count list '{value}': bad entry '{item}' (want N or N(xK))")
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out


def parse_gpu_count(value: str) -> int:
    """GPUs from ``SLURM_GPUS_PER_NODE``-style text: "4", "a100:4", "gpu:a100:4", "a100:2,v100:2" (sums)."""
    total = 0
    # SLURM may append a socket binding, e.g. "gpu:4(S:0-1)" or "gpu:4(S:0,1)".
    for item in re.sub(r"\([^)]*\)", "", value).split(","):
        count = item.strip().rpartition(":")[2]
        if not count.isdigit():
            raise LaunchError(f"GPU count '{value}': bad entry '{item}' (want N or TYPE:N)")
        total += int(count)
    return total


@dataclass(frozen=True)
class Allocation:
    """One SLURM job allocation as seen from one task."""

    hosts: tuple[str, ...]  # every node, allocation order; hosts[0] runs the Ray head and the driver
    node_rank: int  # this task's node index in ``hosts``
    gpus_per_node: int
    cpus_per_node: int

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)


def _int_var(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise LaunchError(f"{name}='{value}' is not a non-negative integer")
    return int(value)


def allocation_from_env(env: Mapping[str, str], use_scontrol: bool = True) -> Allocation:
    """Read the allocation from SLURM's variables (one srun task per node).

    Nodes: SLURM_JOB_NODELIST (or SLURM_NODELIST), checked against SLURM_JOB_NUM_NODES (or SLURM_NNODES).
    Rank: SLURM_NODEID (set by srun), default 0 (the batch script runs on the first node).
    GPUs per node: SLURM_GPUS_ON_NODE, else SLURM_GPUS_PER_NODE, else 0.
    CPUs per node: SLURM_CPUS_ON_NODE, else this node's entry of SLURM_JOB_CPUS_PER_NODE, else 1.
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM_JOB_NODELIST is not set: run inside an allocation (sbatch/salloc) or set it by hand")
    hosts = tuple(hostnames(nodelist, use_scontrol=use_scontrol))
    declared = _int_var(env, "SLURM_JOB_NUM_NODES") or _int_var(env, "SLURM_NNODES")
    if declared is not None and declared != len(hosts):
        raise LaunchError(
            f"SLURM_JOB_NUM_NODES={declared} but SLURM_JOB_NODELIST '{nodelist}' names {len(hosts)} hosts"
        )
    rank = _int_var(env, "SLURM_NODEID") or 0
    if rank >= len(hosts):
        raise LaunchError(f"SLURM_NODEID={rank} is out of range for {len(hosts)} nodes (valid: 0..{len(hosts) - 1})")

    gpus = _int_var(env, "SLURM_GPUS_ON_NODE")
    if gpus is None:
        per_node = env.get("SLURM_GPUS_PER_NODE", "").strip()
        gpus = parse_gpu_count(per_node) if per_node else 0

    cpus = _int_var(env, "SLURM_CPUS_ON_NODE")
    if cpus is None:
        per_node_list = env.get("SLURM_JOB_CPUS_PER_NODE", "").strip()
        counts = expand_counts(per_node_list) if per_node_list else []
        cpus = counts[rank] if rank < len(counts) else 1
    return Allocation(hosts=hosts, node_rank=rank, gpus_per_node=gpus, cpus_per_node=cpus)
