"""SLURM allocation parsing: the compressed nodelist, per-node counts, GPU counts, and the task's view."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "launch" / "slurm"))

from slurm_env import (  # noqa: E402
    LaunchError,
    allocation_from_env,
    expand_counts,
    expand_nodelist,
    parse_gpu_count,
)


@pytest.mark.parametrize(
    "nodelist, expected",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
        ("a[1-2],b3,c[5]", ["a1", "a2", "b3", "c5"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("n[1-2].cluster.org", ["n1.cluster.org", "n2.cluster.org"]),
        ("localhost,localhost", ["localhost", "localhost"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_expand_nodelist(nodelist: str, expected: list[str]) -> None:
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    "nodelist, fragment",
    [
        ("", "empty"),
        ("node[1-3", "unclosed"),
        ("node1-3]", "unmatched"),
        ("node[[1-2]]", "nested"),
        ("node[3-1]", "backwards"),
        ("node[a-b]", "bad range 'a-b'"),
        ("node[1-]", "bad range '1-'"),
        ("a,,b", "empty entry"),
    ],
)
def test_expand_nodelist_rejects_malformed_lists(nodelist: str, fragment: str) -> None:
    with pytest.raises(LaunchError, match=fragment):
        expand_nodelist(nodelist)


def test_expand_counts() -> None:
    assert expand_counts("72(x2),36") == [72, 72, 36]
    assert expand_counts("8") == [8]
    with pytest.raises(LaunchError, match="bad entry 'x'"):
        expand_counts("8,x")


@pytest.mark.parametrize(
    "value, expected",
    [("4", 4), ("a100:4", 4), ("gpu:a100:8", 8), ("a100:2,v100:2", 4), ("gpu:4(S:0-1)", 4), ("gpu:2(S:0,1),gpu:2", 4)],
)
def test_parse_gpu_count(value: str, expected: int) -> None:
    assert parse_gpu_count(value) == expected


def test_parse_gpu_count_rejects_garbage() -> None:
    with pytest.raises(LaunchError, match="GPU count 'a100'"):
        parse_gpu_count("a100")


def base_env(**extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_JOB_NUM_NODES": "4"}
    env.update(extra)
    return env


def test_allocation_reads_rank_gpus_and_cpus() -> None:
    alloc = allocation_from_env(
        base_env(SLURM_NODEID="2", SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96"), use_scontrol=False
    )
    assert alloc.hosts == ("gpu01", "gpu02", "gpu03", "gpu04")
    assert (alloc.num_nodes, alloc.node_rank, alloc.gpus_per_node, alloc.cpus_per_node) == (4, 2, 8, 96)


def test_allocation_fallbacks_gpus_per_node_and_cpus_per_node_list() -> None:
    alloc = allocation_from_env(
        base_env(SLURM_NODEID="3", SLURM_GPUS_PER_NODE="h100:4", SLURM_JOB_CPUS_PER_NODE="64(x3),32"),
        use_scontrol=False,
    )
    assert (alloc.gpus_per_node, alloc.cpus_per_node) == (4, 32)


def test_allocation_defaults_outside_srun() -> None:
    # The batch script itself runs on the first node with no SLURM_NODEID; CPU-only job.
    alloc = allocation_from_env({"SLURM_NODELIST": "cpu7"}, use_scontrol=False)
    assert (alloc.hosts, alloc.node_rank, alloc.gpus_per_node, alloc.cpus_per_node) == (("cpu7",), 0, 0, 1)


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({}, "SLURM_JOB_NODELIST is not set"),
        (base_env(SLURM_JOB_NUM_NODES="3"), "SLURM_JOB_NUM_NODES=3 but .* names 4 hosts"),
        (base_env(SLURM_NODEID="4"), r"SLURM_NODEID=4 is out of range for 4 nodes \(valid: 0..3\)"),
        (base_env(SLURM_CPUS_ON_NODE="lots"), "SLURM_CPUS_ON_NODE='lots' is not a non-negative integer"),
    ],
)
def test_allocation_errors_name_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(LaunchError, match=fragment):
        allocation_from_env(env, use_scontrol=False)
