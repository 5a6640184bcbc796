"""The per-rank reshard planner against the whole-world one: for many training -> rollout layouts,
each rank's own plan must equal the slice of `build_reshard_plan(..., senders="by_rank")` that
concerns it (pieces, local copies, bucket schedule, bytes), every rank must receive exactly its
minimum, the rank plans put together must be the whole-world plan and move the HF weights into
shards cut by hand, and plans that disagree must not combine."""

from __future__ import annotations

import pytest
import torch
from hybrid_reference import expected_vllm_shard, hf_shapes, id_state_dict, tiny_config

from megarl.errors import ConfigError
from megarl.hybrid.executor import execute_plan_locally
from megarl.hybrid.plan import ReshardPlan, build_reshard_plan
from megarl.hybrid.rank_plan import RankPlanner, plan_for_rank
from megarl.hybrid.sender_rule import receivers_at, sender_position
from megarl.layout import ParallelLayout
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import hf_to_megatron_state_dict

pytestmark = pytest.mark.unit

LAYERS = 4
BUCKET = 2048  # small: larger tensors move in several buckets, so the schedule has many steps

# (train layout, rollout tp, engine layout). The tiny model has 4 heads, 2 key/value heads and a
# vocabulary of 150 that Megatron pads to 128 * tp rows and vLLM to 192: the vocabulary splits
# never line up, rollout TP 4 replicates key/value heads, and TP changes in both directions.
LAYOUTS = {
    "tp2->hf": (dict(tp=2), 1, "hf"),
    "pp4->hf": (dict(pp=4), 1, "hf"),
    "tp2pp2dp2->hf": (dict(tp=2, pp=2, dp=2), 1, "hf"),
    "tp2dp3->hf": (dict(tp=2, dp=3), 1, "hf"),
    "cp2dp2->hf": (dict(cp=2, dp=2), 1, "hf"),
    "tp2pp2->vllm1": (dict(tp=2, pp=2), 1, "vllm"),
    "dp2->tp2": (dict(dp=2), 2, "vllm"),
    "tp2dp2->tp2": (dict(tp=2, dp=2), 2, "vllm"),
    "tp2dp2->tp4": (dict(tp=2, dp=2), 4, "vllm"),
    "pp2dp2->tp4": (dict(pp=2, dp=2), 4, "vllm"),
    "tp2pp2dp2->tp2": (dict(tp=2, pp=2, dp=2), 2, "vllm"),
    "tp2pp2dp3cp2->tp4": (dict(tp=2, pp=2, dp=3, cp=2), 4, "vllm"),
    "pp4dp3->tp2": (dict(pp=4, dp=3), 2, "vllm"),
    "tp2pp4dp1->tp4": (dict(tp=2, pp=4), 4, "vllm"),
    "tp2pp2dp16->tp4": (dict(tp=2, pp=2, dp=16), 4, "vllm"),
}


def _spec(tied: bool) -> ModelSpec:
    return ModelSpec.from_hf_config(tiny_config(tied, LAYERS))


def _layouts(name: str) -> tuple[ParallelLayout, ParallelLayout, str]:
    train_kw, rollout_tp, engine = LAYOUTS[name]
    train = ParallelLayout(**{"dp": 1, **train_kw})
    return train, ParallelLayout.rollout(rollout_tp, train.world_size), engine


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_plan_equals_its_slice_of_the_full_plan(name: str, tied: bool) -> None:
    train, rollout, engine = _layouts(name)
    spec, shapes = _spec(tied), hf_shapes(tied, LAYERS)
    full = build_reshard_plan(spec, train, rollout, engine, torch.float64, BUCKET, hf_shapes=shapes, senders="by_rank")
    planner = RankPlanner(spec, train, rollout, engine, torch.float64, BUCKET, hf_shapes=shapes)
    sent = received = 0
    for rank in range(train.world_size):
        mine, reference = planner.plan(rank), full.restrict(rank)
        assert mine.ranks == [rank]
        for part in ("engine_tensors", "train_tensors", "local_pieces", "steps", "bytes"):
            assert getattr(mine, part) == getattr(reference, part), f"rank {rank}: {part}"
        counts = mine.bytes[rank]
        assert counts.received == counts.minimum
        assert all(rank in pair for step in mine.steps for pair in step)
        sent, received = sent + counts.sent, received + counts.received
    assert sent == received == full.total_received() == sum(b.minimum for b in full.bytes.values())
    # The whole-world plan is the union of the rank plans (steps without pairs aside: none here).
    assert ReshardPlan.union([planner.plan(r) for r in range(train.world_size)]) == full


@pytest.mark.parametrize("name", ["tp2pp2dp2->hf", "tp2dp2->tp4", "tp2pp2dp3cp2->tp4", "pp4dp3->tp2"])
def test_rank_plans_together_deliver_hand_cut_shards(name: str) -> None:
    train, rollout, engine = _layouts(name)
    spec, shapes = _spec(False), hf_shapes(False, LAYERS)
    hf = id_state_dict(shapes)
    planner = RankPlanner(spec, train, rollout, engine, torch.float64, BUCKET, hf_shapes=shapes)
    plan = ReshardPlan.union([planner.plan(r) for r in range(train.world_size)])
    shards = {}
    for rank in range(train.world_size):
        c = train.coord(rank)
        shards[rank] = hf_to_megatron_state_dict(hf, spec, c.tp_rank, train.tp, c.pp_rank, train.pp)
    for rank, (tensors, stats) in execute_plan_locally(plan, shards).items():
        expected = hf if engine == "hf" else expected_vllm_shard(hf, rank % rollout.tp, rollout.tp, LAYERS, False)
        assert sorted(tensors) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(tensors[key], value), f"rank {rank}: {key}"
        # Independent minimum: elements (unique ids) of the rollout shard the training shard lacks.
        held = torch.cat([t.reshape(-1) for t in shards[rank].values()])
        wanted = torch.cat([t.reshape(-1) for t in expected.values()])
        wanted = wanted[wanted != 0]  # vocabulary padding is zero-filled, not moved
        assert stats.bytes_received == int((~torch.isin(wanted, held)).sum()) * 8


@pytest.mark.parametrize("degrees", [dict(tp=2, pp=2, dp=3, cp=2), dict(tp=4, dp=5), dict(pp=3, dp=2, cp=3),
                                     dict(tp=2, pp=2, dp=4, cp=2, ep=4), dict(tp=2, pp=2, dp=4, ep=4, etp=1),
                                     dict(tp=1, pp=2, dp=4, ep=2, etp=2), dict(tp=4, dp=2, cp=2, ep=2, etp=2)])
def test_receivers_at_inverts_the_sender_rule(degrees: dict) -> None:
    train = ParallelLayout(**degrees)
    replicas = train.dp * train.cp
    for expert, per_holder in [(False, replicas), (True, train.edp)]:
        for holders in (1, 2, 3):
            n = holders * per_holder
            for salt in (0, 1, 7):
                for position in range(n):
                    brute = sorted(r for r in range(train.world_size)
                                   if sender_position(train, r, holders, per_holder, salt, expert) == position)
                    listed = receivers_at(train, position, holders, per_holder, salt, expert)
                    assert sorted(listed) == brute, (expert, per_holder, holders, salt, position)


def test_replicas_share_the_sending() -> None:
    # TP2 x DP4 -> HF engine: ranks 0/2/4/6 hold TP shard 0, ranks 1/3/5/7 shard 1; each rank
    # needs the other shard. The rule spreads receivers over the four replicas of each shard.
    train, rollout, engine = ParallelLayout(tp=2, dp=4), ParallelLayout.rollout(1, 8), "hf"
    planner = RankPlanner(_spec(False), train, rollout, engine, torch.float64, BUCKET, hf_shapes=hf_shapes(False, LAYERS))
    plans = [planner.plan(r) for r in range(8)]
    for tp_rank in (0, 1):
        sent = [plans[r].bytes[r].sent for r in train.replicas(tp_rank, 0)]
        senders_of = {pair[0] for p in plans for step in p.steps for pair in step if pair[1] == tp_rank}
        assert min(sent) > 0 and max(sent) <= 1.5 * min(sent), sent
        assert len(senders_of) > 1  # one receiver's rows come from several replicas


def test_tables_do_not_grow_with_data_parallel_size() -> None:
    spec, shapes = _spec(False), hf_shapes(False, LAYERS)
    sizes = []
    for dp in (1, 4, 64):
        train = ParallelLayout(tp=2, pp=2, dp=dp)
        planner = RankPlanner(spec, train, ParallelLayout.rollout(4, train.world_size), "vllm", torch.float64,
                              BUCKET, hf_shapes=shapes)
        plan = planner.plan(train.world_size - 1)
        sizes.append((len(planner.shards), len(planner.params), len(planner._templates),
                      sum(len(v) for v in planner.sources.values())))
        assert plan.bytes[train.world_size - 1].received == plan.bytes[train.world_size - 1].minimum
    assert sizes[0] == sizes[1] == sizes[2]


def test_bad_rank_and_inputs_are_refused() -> None:
    spec, shapes = _spec(False), hf_shapes(False, LAYERS)
    train = ParallelLayout(tp=2, dp=2)
    with pytest.raises(ConfigError, match=r"rank 4 outside the world \[0, 4\)"):
        plan_for_rank(spec, train, ParallelLayout.rollout(2, 4), 4, "vllm", hf_shapes=shapes)
    with pytest.raises(ConfigError, match="world size"):
        RankPlanner(spec, train, ParallelLayout.rollout(1, 8), "hf", hf_shapes=shapes)
    with pytest.raises(ConfigError, match="bucket_bytes"):
        RankPlanner(spec, train, ParallelLayout.rollout(1, 4), "hf", bucket_bytes=0, hf_shapes=shapes)
    with pytest.raises(ConfigError, match="senders='nearest' unknown"):
        build_reshard_plan(spec, train, ParallelLayout.rollout(1, 4), "hf", hf_shapes=shapes, senders="nearest")


def test_union_refuses_plans_that_do_not_fit_together() -> None:
    spec, shapes = _spec(False), hf_shapes(False, LAYERS)
    train = ParallelLayout(pp=2, dp=2)  # every rank lacks the other stage
    planner = RankPlanner(spec, train, ParallelLayout.rollout(2, 4), "vllm", torch.float64, BUCKET, hf_shapes=shapes)
    plans = [planner.plan(r) for r in range(4)]
    with pytest.raises(ConfigError, match=r"ranks \[1\] are covered by two plans"):
        ReshardPlan.union([plans[0], plans[1], plans[1]])
    other = RankPlanner(spec, train, ParallelLayout.rollout(2, 4), "vllm", torch.float64, 2 * BUCKET,
                        hf_shapes=shapes).plan(1)
    with pytest.raises(ConfigError, match="another layout, engine, dtype or bucket size"):
        ReshardPlan.union([plans[0], other])
    # Rank 0 receives from some rank whose plan then claims another bucket for that pair.
    k, pair = next((k, pair) for k, step in enumerate(plans[0].steps) for pair in step if pair[1] == 0)
    sender = plans[pair[0]]
    changed = [dict(step) for step in sender.steps]
    changed[k][pair] = changed[k][pair][:-1] or changed[k][pair] * 2
    forged = ReshardPlan(sender.train, sender.rollout, sender.engine, sender.dtype, sender.bucket_bytes,
                         sender.engine_tensors, sender.train_tensors, sender.local_pieces, changed, sender.bytes)
    with pytest.raises(ConfigError, match=f"ranks {pair[0]} and 0 disagree on their bucket of step {k}"):
        ReshardPlan.union([plans[0], forged])
    with pytest.raises(ConfigError, match=r"the plan does not cover rank 2 \(it covers \[0\]\)"):
        plans[0].restrict(2)
