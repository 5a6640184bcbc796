"""megarl.layout: rank <-> coordinates of training and rollout layouts, checked against Megatron-Core's
own rank generator (the groups `initialize_model_parallel` creates), and the layout errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from megatron.core.parallel_state import RankGenerator

from megarl.errors import ConfigError
from megarl.layout import ParallelLayout, RankCoord

LAYOUTS = [
    ParallelLayout(dp=1),
    ParallelLayout(tp=2, dp=1),
    ParallelLayout(dp=4),
    ParallelLayout(tp=2, pp=2, dp=2, cp=2),
    ParallelLayout(tp=3, pp=2, dp=2),
    ParallelLayout(tp=2, cp=3, dp=2, pp=1),
    ParallelLayout(tp=1, pp=3, dp=4, ep=2),
    ParallelLayout(tp=2, pp=2, dp=2, cp=2, ep=4),
    ParallelLayout(tp=2, dp=3, cp=2, ep=3),
    ParallelLayout(tp=2, pp=2, dp=2, ep=4, etp=1),
    ParallelLayout(tp=4, dp=2, cp=2, ep=2, etp=2),
    ParallelLayout(tp=1, dp=4, ep=2, etp=2),
    ParallelLayout(tp=2, dp=2, cp=2, etp=4),
]
DIMS = ("tp", "cp", "dp", "pp")


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_coord_and_rank_round_trip_over_every_rank(layout: ParallelLayout) -> None:
    coords = [layout.coord(r) for r in range(layout.world_size)]
    assert [layout.rank(c) for c in coords] == list(range(layout.world_size))
    assert [c.rank for c in coords] == list(range(layout.world_size))
    assert len({tuple(getattr(c, f"{d}_rank") for d in DIMS) for c in coords}) == layout.world_size
    for c in coords:
        assert (c.tp_size, c.pp_size, c.dp_size, c.cp_size, c.ep_size) == (
            layout.tp, layout.pp, layout.dp, layout.cp, layout.ep)
    assert layout.world_size == layout.model_parallel_size * layout.dp


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_equal_megatron_core_rank_generator(layout: ParallelLayout) -> None:
    """Every TP/CP/DP/PP group of Megatron's default order holds the ranks that differ only in
    that coordinate, in coordinate order; every EP group of its expert generator likewise."""
    coords = [layout.coord(r) for r in range(layout.world_size)]
    dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    for dim in DIMS:
        groups = dense.get_ranks(dim)
        ours: dict[tuple, list[int]] = {}
        for c in coords:  # ranks sharing every other coordinate, listed by this one
            key = tuple(getattr(c, f"{d}_rank") for d in DIMS if d != dim)
            ours.setdefault(key, []).append(c.rank)
        assert sorted(groups) == sorted(ours.values()), dim
        for group in groups:
            assert [getattr(coords[r], f"{dim}_rank") for r in group] == list(range(len(group))), (dim, group)
    # Experts: the ranks of a stage regrouped by expert TP, EP and expert DP, as
    # `initialize_model_parallel(expert_tensor_parallel_size=etp)` builds its expert generator.
    edp = layout.tp * layout.cp * layout.dp // (layout.etp * layout.ep)
    assert layout.edp == edp
    expert = RankGenerator(tp=layout.etp, ep=layout.ep, dp=edp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")
    for dim, size in (("ep", layout.ep), ("tp", layout.etp), ("dp", edp)):
        for group in expert.get_ranks(dim):
            assert [getattr(coords[r], f"{'e' + dim if dim != 'ep' else dim}_rank") for r in group] == list(
                range(size)), (dim, group)
    for c in coords:
        assert layout.expert_rank(c.etp_rank, c.ep_rank, c.edp_rank, c.pp_rank) == c.rank


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_replicas_are_the_dp_and_cp_ranks_of_one_model_shard(layout: ParallelLayout) -> None:
    for tp_rank in range(layout.tp):
        for pp_rank in range(layout.pp):
            replicas = layout.replicas(tp_rank, pp_rank)
            assert len(replicas) == layout.dp * layout.cp
            assert all((layout.coord(r).tp_rank, layout.coord(r).pp_rank) == (tp_rank, pp_rank) for r in replicas)
            # DP-major order: the reshard plan's sender choice breaks ties by it.
            assert [(layout.coord(r).dp_rank, layout.coord(r).cp_rank) for r in replicas] == sorted(
                (d, c) for d in range(layout.dp) for c in range(layout.cp))


def test_resolved_derives_dp_and_reports_what_is_wrong() -> None:
    assert ParallelLayout(tp=2, pp=2).resolved(8) == ParallelLayout(tp=2, pp=2, dp=2)
    assert ParallelLayout(cp=2, ep=4).resolved(8).dp == 4
    assert ParallelLayout(tp=2, dp=2).resolved(4).dp == 2
    assert ParallelLayout(tp=2).etp == 2 and ParallelLayout(tp=2, etp=1).resolved(4).edp == 4
    cases = [
        (ParallelLayout(cp=0), 2, "cp=0 must be >= 1"),
        (ParallelLayout(ep=0), 2, "ep=0 must be >= 1"),
        (ParallelLayout(tp=3), 4, r"world size 4 is not divisible by tp\*pp\*cp = 3\*1\*1 = 3"),
        (ParallelLayout(tp=2, dp=3), 4, r"dp=3 but world size 4 / \(tp\*pp\*cp=2\) = 2"),
        (ParallelLayout(ep=3), 4, r"ep=3 must divide dp\*cp=4"),
        (ParallelLayout(tp=2, ep=3, etp=1), 4, r"etp\*ep = 1\*3 must divide the 4 ranks .*tp\*cp\*dp = 2\*1\*2"),
        (ParallelLayout(tp=2, etp=-1), 4, "etp=-1 must be >= 1"),
    ]
    for layout, world, message in cases:
        with pytest.raises(ConfigError, match=message):
            layout.resolved(world)


def test_an_unresolved_layout_has_no_ranks() -> None:
    with pytest.raises(ConfigError, match="dp is not resolved"):
        ParallelLayout(tp=2).world_size
    with pytest.raises(ConfigError, match="dp is not resolved"):
        ParallelLayout(tp=2).coord(0)
    with pytest.raises(ConfigError, match=r"rank 4 outside \[0, 4\)"):
        ParallelLayout(tp=2, dp=2).coord(4)
    with pytest.raises(ConfigError, match="of another layout"):
        ParallelLayout(tp=2, dp=2).rank(ParallelLayout(tp=4, dp=1).coord(0))


def test_rollout_layout_groups_consecutive_ranks_into_engines() -> None:
    layout = ParallelLayout.rollout(2, 8)
    assert layout == ParallelLayout(tp=2, dp=4) and layout.world_size == 8
    assert [(c.dp_rank, c.tp_rank) for c in map(layout.coord, range(8))] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert [c.rank for c in map(layout.coord, range(8)) if c.is_collect_rank] == [0, 2, 4, 6]
    for tp, world in ((0, 4), (3, 4), (1, 0)):
        with pytest.raises(ConfigError, match=f"rollout layout: tensor_model_parallel_size={tp} must be >= 1 "
                                              f"and divide the world size {world}"):
            ParallelLayout.rollout(tp, world)


def test_collect_rank_is_the_last_stage_at_tp_and_cp_rank_0() -> None:
    layout = ParallelLayout(tp=2, pp=2, dp=2, cp=2)
    collect = [c for c in map(layout.coord, range(layout.world_size)) if c.is_collect_rank]
    assert [(c.dp_rank, c.pp_rank, c.tp_rank, c.cp_rank) for c in collect] == [(0, 1, 0, 0), (1, 1, 0, 0)]
    only_dp = [RankCoord.data_parallel_only(r, 3) for r in range(3)]
    assert all(c.is_collect_rank for c in only_dp) and [c.dp_rank for c in only_dp] == [0, 1, 2]
    assert {c.dp_size for c in only_dp} == {3}


def test_the_layout_module_imports_no_torch() -> None:
    code = "import sys, megarl.layout; assert 'torch' not in sys.modules, 'megarl.layout imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
