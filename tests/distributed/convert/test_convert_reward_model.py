"""A reward model (HF `*ForSequenceClassification`, one label) through `megarl convert`.

- hf-to-mcore and back with the command line: every tensor bit-exact (the `score` head included),
  the architecture kept, for Qwen2 and Llama.
- The converted checkpoint as `reward_model.model_path`: the reward-model role loads it at TP=2 and
  at PP=2 and scores like transformers (float64 reference).
- A reward model whose model_type no family lists, converted with `--spec qwen2`: the role builds
  it with the family the checkpoint records.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _launch import run_distributed  # noqa: E402
from engine_helpers import make_batch, make_hf_model  # noqa: E402

from megarl.cli import main as megarl_main  # noqa: E402
from megarl.rewards.model_checkpoint import reward_model_problems  # noqa: E402

pytestmark = pytest.mark.distributed

PAD = 0


def _save_reward_model(kind: str, path: Path) -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    config = make_hf_model(kind, seed=2).config
    config.num_labels = 1
    config.pad_token_id = PAD
    torch.manual_seed(21)
    rm = AutoModelForSequenceClassification.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in rm.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
        rm.score.weight.normal_(0.0, 0.5)
    rm.save_pretrained(path, safe_serialization=True)
    return rm


def _scores(rank: int, world: int, port: int, ckpt: str, batch: dict,
            layouts: tuple[dict, ...] = (dict(tp=2), dict(pp=2))) -> list:
    from megarl.layout import ParallelLayout
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.workers.roles import RewardModelRole
    from megarl.workers.specs import EngineRoleSpec

    out = []
    for layout_kw in layouts:
        layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
        spec = EngineRoleSpec(name="reward_model", model_dir=ckpt, layout=layout,
                              engine=EngineConfig(role="reward", micro_batch_size=2, trained=False))
        role = RewardModelRole(SimpleNamespace(rank=rank), spec)
        role.init_model()
        out.append(role.compute_rm_score(batch)["rm_scores"])
    return out


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_reward_model_round_trip_is_bit_exact_and_the_converted_model_scores(kind: str, tmp_path: Path) -> None:
    rm = _save_reward_model(kind, tmp_path / "hf")
    assert megarl_main(["convert", "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mcore"),
                        "--tp", "2", "--quiet"]) == 0
    assert megarl_main(["convert", "mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "back"),
                        "--quiet"]) == 0
    want, got = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(got) == sorted(want) and "score.weight" in got
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{kind}: tensors changed by the round trip: {differ}"
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [type(rm).__name__] and len(config["id2label"]) == 1
    # Both forms pass the reward-model checks that config validation runs.
    assert reward_model_problems(str(tmp_path / "back"), None) == []
    assert reward_model_problems(str(tmp_path / "mcore"), None) == []

    batch = make_batch(seed=6, batch=4)
    valid = batch["attention_mask"].bool()
    ids = torch.where(valid & (batch["input_ids"] == PAD), torch.ones_like(batch["input_ids"]), batch["input_ids"])
    ids = torch.where(valid, ids, torch.full_like(ids, PAD))
    p = batch["prompts"].shape[1]
    with torch.no_grad():
        reference = copy.deepcopy(rm).double()(input_ids=ids, attention_mask=batch["attention_mask"],
                                               position_ids=batch["position_ids"]).logits[:, 0]
    engine_batch = {"input_ids": ids, "attention_mask": batch["attention_mask"], "responses": ids[:, p:]}
    for rank, per_layout in enumerate(run_distributed(_scores, 2, str(tmp_path / "mcore"), engine_batch)):
        for layout, scores in zip(("tp=2", "pp=2"), per_layout):
            err = (scores.double() - reference).abs().max().item()
            assert err < 1e-5, f"{kind} rank {rank} {layout}: converted reward model differs from transformers by {err}"


def _engine_batch_and_reference(rm: torch.nn.Module) -> tuple[dict, torch.Tensor]:
    batch = make_batch(seed=6, batch=4)
    valid = batch["attention_mask"].bool()
    ids = torch.where(valid & (batch["input_ids"] == PAD), torch.ones_like(batch["input_ids"]), batch["input_ids"])
    ids = torch.where(valid, ids, torch.full_like(ids, PAD))
    p = batch["prompts"].shape[1]
    with torch.no_grad():
        reference = copy.deepcopy(rm).double()(input_ids=ids, attention_mask=batch["attention_mask"],
                                               position_ids=batch["position_ids"]).logits[:, 0]
    return {"input_ids": ids, "attention_mask": batch["attention_mask"], "responses": ids[:, p:]}, reference


def test_a_reward_model_converted_with_spec_loads_with_the_recorded_family(tmp_path: Path) -> None:
    rm = _save_reward_model("qwen2", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["model_type"] = "my_qwen2_rm"  # a variant no family lists: only --spec maps it
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert megarl_main(["convert", "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mcore"),
                        "--spec", "qwen2", "--quiet"]) == 0
    assert reward_model_problems(str(tmp_path / "mcore"), None) == []
    engine_batch, reference = _engine_batch_and_reference(rm)
    for rank, per_layout in enumerate(run_distributed(_scores, 2, str(tmp_path / "mcore"), engine_batch,
                                                      (dict(tp=2),))):
        err = (per_layout[0].double() - reference).abs().max().item()
        assert err < 1e-5, f"rank {rank}: the reward model differs from transformers by {err}"
