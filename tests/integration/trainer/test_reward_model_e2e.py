"""End-to-end runs with a Megatron reward model: PPO with the reward model in its own pool (and the
critic started from the reward model's checkpoint), and GRPO with a colocated, offloaded reward
model with a tokenizer of its own (the text re-tokenised through its chat template) mixed with the
rule scorer on a dataset whose rows are of both styles. Each response's reward-model score, as
dumped by the run, is checked against transformers' sequence-classification output on the same
text (float64). A colocated reward model scores with the rollout engine asleep
(`rollout.free_cache_engine`), in training, in validation and in each of DAPO's rounds."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_train_e2e import (  # noqa: E402,F401
    MIXED_REWARD,
    read_memory_trace,
    read_metrics,
    run_train,
    task_dir,
    write_config,
)

from megarl.convert.mcore_to_hf import convert_mcore_to_hf  # noqa: E402
from megarl.data.tokenizer import build_char_tokenizer, load_tokenizer  # noqa: E402
from megarl.trainer.checkpoint_verify import verify_trainer_checkpoint  # noqa: E402

pytestmark = pytest.mark.integration


CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"


def make_reward_model(task: Path, out: Path, own_tokenizer: bool = False) -> transformers.PreTrainedModel:
    """A random tiny Qwen2 sequence-classification model. By default over the task's tokenizer (no
    tokenizer of its own: it reads the actor's token ids); with `own_tokenizer`, over a character
    tokenizer of its own whose ids differ from the actor's (the task's characters in reverse order,
    then the chat template's), with a chat template."""
    tokenizer = load_tokenizer(task / "tokenizer")
    if own_tokenizer:
        chars = [t for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
                 if t not in tokenizer.all_special_tokens]
        tokenizer = build_char_tokenizer(list(reversed(chars)) + list("ua:;"), out, chat_template=CHAT_TEMPLATE)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=32, tie_word_embeddings=False, num_labels=1,
                                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(5)
    model = transformers.Qwen2ForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # scores of order 1 that differ between responses
    model.save_pretrained(out, safe_serialization=True)
    return model


def reference_scores(model: transformers.PreTrainedModel, tokenizer, rows: list[dict],
                     chat: bool = False) -> torch.Tensor:
    """transformers' score (float64) of each dumped prompt + response text, one sequence at a time.
    `chat`: the text is "u:<prompt>;a:<response>;" (what CHAT_TEMPLATE renders) without the
    response's special tokens, as the driver re-tokenises for a reward model of another vocabulary.
    Each sequence is scored at its last token, as megarl scores a response at its last one: with a
    pad_token_id, transformers would take the last token that is not padding, and a random model
    samples the padding id as a response token too."""
    ref = model.double()
    ref.config.pad_token_id = None  # one unpadded sequence at a time: its last token
    out = []
    with torch.no_grad():
        for row in rows:
            text = row["input"] + row["output"]
            if chat:
                response = row["output"]
                for special in ("<eos>", "<pad>", "<bos>", "<unk>"):
                    response = response.replace(special, "")
                text = f"u:{row['input']};a:{response};"
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out.append(ref(input_ids=ids).logits[0, 0])
    return torch.stack(out)


def dumped(rollouts: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (rollouts / f"{step}.jsonl").read_text().splitlines()]


def test_ppo_with_reward_model_in_its_own_pool_and_critic_from_it(tmp_path: Path, task_dir: Path) -> None:
    rm = make_reward_model(task_dir, tmp_path / "rm")
    rollouts = tmp_path / "rollouts"
    config = write_config(
        tmp_path, task_dir,
        algorithm={"adv_estimator": "gae"},
        critic={"model_path": str(tmp_path / "rm"), "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8},
        reward_model={"enable": True, "model_path": str(tmp_path / "rm"), "combine": "weighted_sum",
                      "rule_weight": 0.0, "model_weight": 1.0, "micro_batch_size_per_gpu": 4,
                      "megatron": {"tensor_model_parallel_size": 1}},
        resources={"reward_model_pool": {"nnodes": 1, "devices_per_node": 1}},
        trainer={"total_training_steps": 2, "rollout_data_dir": str(rollouts), "save_freq": 2},
        rollout={"n": 2},
    )
    proc = run_train(config)
    assert proc.returncode == 0
    # The critic, started from the reward model (hidden 64), saves beside an actor of another size
    # (hidden 128, whose initial_model/ is in the run directory): its checkpoint verifies against its
    # own model, as a resume verifies it, and exports with the reward model's config.
    step_dir = tmp_path / "run" / "checkpoints" / "global_step_2"
    report = verify_trainer_checkpoint(step_dir)
    assert report.ok, report.message()
    convert_mcore_to_hf(step_dir / "critic", tmp_path / "critic_hf", progress=False)
    exported = json.loads((tmp_path / "critic_hf" / "config.json").read_text())
    assert (exported["hidden_size"], exported["architectures"]) == (64, ["Qwen2ForSequenceClassification"])
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2]
    for step, m in metrics.items():
        for key in ("reward_model/score/mean", "reward_model/score/max", "reward_model/score/min",
                    "critic/vf_loss", "critic/values/mean"):
            assert key in m and math.isfinite(m[key]), f"step {step}: {key} missing or not finite"
        # The reward is the reward model's score alone (rule_weight 0).
        assert m["critic/score/mean"] == pytest.approx(m["reward_model/score/mean"], abs=1e-6)
        rows = dumped(rollouts, step)
        assert len(rows) == 8
        got = torch.tensor([r["rm_score"] for r in rows], dtype=torch.float64)
        want = reference_scores(rm, load_tokenizer(task_dir / "tokenizer"), rows)
        err = (got - want).abs().max().item()
        assert err < 1e-5, f"step {step}: reward-model scores differ from transformers by {err}"
        assert torch.allclose(torch.tensor([r["score"] for r in rows], dtype=torch.float64), got, atol=1e-6)
        assert m["reward_model/score/max"] == pytest.approx(float(got.max()), abs=1e-6)
    # The reward model ran in its own process group, beside the hybrid actor's two processes.
    assert "WorkerGroup('reward_model', world_size=1" in proc.stderr + proc.stdout


def mixed_styles(task: Path, out: Path) -> Path:
    """The task's training rows, every other one turned into a reward-model row: style "model", a
    data source no rule scorer knows, no ground truth."""
    rows = pq.read_table(task / "train.parquet").to_pylist()
    for row in rows[1::2]:
        row["data_source"] = "preference"
        row["reward_model"] = {"style": "model", "ground_truth": None}
    pq.write_table(pq.read_table(task / "train.parquet").from_pylist(rows), out)
    return out


def test_grpo_with_colocated_reward_model_mixed_with_rule_scorer(tmp_path: Path, task_dir: Path) -> None:
    rm = make_reward_model(task_dir, tmp_path / "rm", own_tokenizer=True)
    rollouts = tmp_path / "rollouts"
    config = write_config(
        tmp_path, task_dir,
        data={"train_files": [str(mixed_styles(task_dir, tmp_path / "mixed.parquet"))]},
        reward_model={"enable": True, "model_path": str(tmp_path / "rm"), "combine": "weighted_sum",
                      "rule_weight": 1.0, "model_weight": 0.5, "param_offload": True},
        reward={"reward_kwargs": {"arithmetic": {"mode": "startswith"}}},
        trainer={"total_training_steps": 2, "rollout_data_dir": str(rollouts)},
    )
    proc = run_train(config)
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2]
    seen: set[str] = set()
    for step in (1, 2):
        rows = dumped(rollouts, step)
        assert len(rows) == 16
        rm_scores = torch.tensor([r["rm_score"] for r in rows], dtype=torch.float64)
        want = reference_scores(rm, load_tokenizer(tmp_path / "rm"), rows, chat=True)
        err = (rm_scores - want).abs().max().item()
        assert err < 1e-5, f"step {step}: reward-model scores differ from transformers by {err}"
        # Rows of style "rule": rule score + 0.5 x reward-model score; rows of style "model": 0.5 x
        # the reward-model score alone (the rule scorer never sees them: it knows no "preference").
        seen |= {r["data_source"] for r in rows}
        for r in rows:
            rule = r["reward_info/score"] if r["data_source"] == "arithmetic" else 0.0
            assert r["score"] == pytest.approx(rule + 0.5 * r["rm_score"], abs=1e-5)
        assert metrics[step]["reward_model/score/mean"] == pytest.approx(float(rm_scores.mean()), abs=1e-5)
    assert seen == {"arithmetic", "preference"}
    # Colocated and offloaded: onloaded for the reward phase only. With rollout.free_cache_engine (the
    # default) the rollout engine, in the same processes, sleeps before the reward model comes in (as
    # verl's does), in training and in the validation after step 2: the reward model takes the memory
    # of the engine's KV cache instead of coming on top of it. One sleep a step, none after scoring.
    # Step 1 starts from an engine that is awake; later syncs wake its weights, then its KV cache.
    scoring = [("gen", "rollout", "sleep"), ("reward", "reward_model", "onload:params"),
               ("reward", "reward_model", "offload")]
    trace = read_memory_trace(tmp_path / "run", with_val=True)
    assert trace[1] == scoring, trace[1]
    waking = [("sync_weights", "rollout", "wake_up:weights"), ("sync_weights", "rollout", "wake_up")]
    in_val = [("val", role, transition) for _, role, transition in waking + scoring]
    assert trace[2] == waking + scoring + in_val, trace[2]


def test_dapo_rounds_score_with_the_colocated_reward_model_while_the_rollout_sleeps(tmp_path: Path,
                                                                                   task_dir: Path) -> None:
    """DAPO generates, scores and filters in rounds until the batch is full: with a reward model in the
    rollout's processes the engine sleeps before each round's scoring and the next round's generation
    wakes it (its weights first, discarded by sleep_level 2 and synced again, then its KV cache): one
    sleep a round, and no sleep after the last round's scoring."""
    make_reward_model(task_dir, tmp_path / "rm")
    reward_file = tmp_path / "mixed_reward.py"
    reward_file.write_text(MIXED_REWARD)  # half the groups score alike: filtered, so more rounds run
    config = write_config(
        tmp_path, task_dir,
        data={"val_files": []},
        algorithm={"filter_groups": {"enable": True, "metric": "seq_reward", "max_num_gen_batches": 20}},
        reward={"custom_reward_function": {"path": str(reward_file)}},
        # The rule score decides the filter; the reward model runs on every row of every round.
        reward_model={"enable": True, "model_path": str(tmp_path / "rm"), "combine": "weighted_sum",
                      "rule_weight": 1.0, "model_weight": 0.0, "param_offload": True},
        trainer={"total_training_steps": 1},
    )
    proc = run_train(config)
    assert proc.returncode == 0
    rounds = int(read_metrics(tmp_path / "run")[1]["train/num_gen_batches"])
    assert rounds >= 2
    scoring = [("gen", "rollout", "sleep"), ("reward", "reward_model", "onload:params"),
               ("reward", "reward_model", "offload")]
    waking = [("sync_weights", "rollout", "wake_up:weights"), ("sync_weights", "rollout", "wake_up")]
    assert read_memory_trace(tmp_path / "run")[1] == scoring + (waking + scoring) * (rounds - 1)
