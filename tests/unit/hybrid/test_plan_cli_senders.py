"""`megarl sync plan --senders`: the per-rank planner's summary (every rank's receiving half put
together) must equal the summary of the whole-world plan built with the same sender rule, and
receive the same bytes as the least-loaded whole-world plan; the default is the per-rank planner
(what the weight sync runs) at any world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hybrid_reference import hf_shapes, tiny_config

from megarl.cli import main
from megarl.hybrid.plan import build_reshard_plan
from megarl.hybrid.plan_cli import summarize
from megarl.layout import ParallelLayout
from megarl.models.spec import ModelSpec

pytestmark = pytest.mark.unit

LAYERS = 4


@pytest.fixture()
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config(False, LAYERS)))
    return path


def plan_json(capsys: pytest.CaptureFixture, config: Path, train: str, rollout_tp: int, *extra: str) -> dict:
    assert main(["sync", "plan", str(config), "--train", train, "--rollout-tp", str(rollout_tp), "--dtype", "fp32",
                 "--bucket-mib", "0.001", "--gpus-per-node", "4", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("train, rollout_tp", [("tp=2,pp=2,dp=4", 2), ("tp=2,dp=3", 1), ("pp=2,dp=2,cp=2", 4)])
def test_by_rank_summary_equals_the_whole_world_plan_with_the_same_rule(
        capsys: pytest.CaptureFixture, config: Path, train: str, rollout_tp: int) -> None:
    by_rank = plan_json(capsys, config, train, rollout_tp, "--senders", "by_rank")
    least = plan_json(capsys, config, train, rollout_tp, "--senders", "least_loaded")
    assert (by_rank["senders"], least["senders"]) == ("by_rank", "least_loaded")
    # Independent path: the whole-world planner with the same rule, summarized plan by plan.
    degrees = dict(part.split("=") for part in train.split(","))
    layout = ParallelLayout(**{k: int(v) for k, v in degrees.items()})
    spec = ModelSpec.from_hf_config(tiny_config(False, LAYERS))
    full = build_reshard_plan(spec, layout, ParallelLayout.rollout(rollout_tp, layout.world_size),
                              "hf" if rollout_tp == 1 else "vllm", torch.float32, int(0.001 * 2**20),
                              hf_shapes=hf_shapes(False, LAYERS), senders="by_rank")
    reference = json.loads(json.dumps(summarize(full, 4, 150.0, 25.0, senders="by_rank")))
    assert by_rank == reference
    assert by_rank["bytes_received"] == by_rank["bytes_minimum"] == least["bytes_received"] > 0
    assert [r["received"] for r in by_rank["ranks"].values()] == [r["received"] for r in least["ranks"].values()]
    assert sum(r["sent"] for r in by_rank["ranks"].values()) == by_rank["bytes_received"]


def test_default_plans_rank_by_rank_as_the_weight_sync(capsys: pytest.CaptureFixture, config: Path) -> None:
    assert plan_json(capsys, config, "tp=2,dp=2", 2)["senders"] == "by_rank"  # 4 ranks
    big = plan_json(capsys, config, "tp=2,pp=2,dp=32", 2)  # 128 ranks
    assert big["senders"] == "by_rank" and big["world_size"] == 128
    assert big["bytes_received"] == big["bytes_minimum"]
    assert main(["sync", "plan", str(config), "--train", "tp=2,dp=2", "--rollout-tp", "1"]) == 0
    assert "senders           by_rank (each rank's own plan, as the weight sync runs it)" in capsys.readouterr().out


def test_expert_parallel_layout_is_planned(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps(dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=150, hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=False,
        max_position_embeddings=64, rms_norm_eps=1e-6)))
    least = plan_json(capsys, moe, "dp=4,ep=2", 1, "--senders", "least_loaded")
    by_rank = plan_json(capsys, moe, "dp=4,ep=2", 1, "--senders", "by_rank")
    assert least["train"]["ep"] == 2
    # Each rank lacks exactly the other expert-parallel rank's half of the experts.
    assert least["bytes_received"] == least["bytes_minimum"] == by_rank["bytes_received"] > 0
    assert len({r["received"] for r in by_rank["ranks"].values()}) == 1
    # Expert tensor parallelism other than TP: TP=2 with whole experts over EP=4 (8 ranks, expert DP 1).
    etp = plan_json(capsys, moe, "tp=2,dp=4,ep=4,etp=1", 2)
    assert etp["train"]["etp"] == 1 and etp["world_size"] == 8
    assert etp["bytes_received"] == etp["bytes_minimum"] > 0
    etp_least = plan_json(capsys, moe, "tp=2,dp=4,ep=4,etp=1", 2, "--senders", "least_loaded")
    assert etp_least["bytes_received"] == etp["bytes_received"]
    assert main(["sync", "plan", str(moe), "--train", "dp=4,ep=4,etp=2", "--rollout-tp", "1"]) == 1
    assert "etp*ep = 2*4 must divide the 4 ranks of a pipeline stage" in capsys.readouterr().err
