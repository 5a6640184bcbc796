"""Multi-turn rollouts with a calculator tool through `megarl train`: a real tiny model, Megatron
actor at TP=2, the HF engine, the agent loop in the rollout workers, the real reward manager.

The model is first fitted for a few seconds on calculator demonstrations (megarl.agent.warm_start),
so that it samples well-formed calls; then two GRPO steps run with `rollout.multi_turn.enable`.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.agent.warm_start import conversation_ids, fit_demonstrations
from megarl.data.parquet_io import write_parquet
from megarl.data.tasks.arithmetic_tools import ArithmeticToolsTask, build_tools_tokenizer, call_text

pytestmark = pytest.mark.integration

TINY = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("tools")
    tokenizer = build_tools_tokenizer(out / "tokenizer")
    task = ArithmeticToolsTask(digits=3)
    rng = random.Random(0)
    episodes = []
    for _ in range(256):
        expression, answer = task.sample(rng)
        episodes.append(conversation_ids(tokenizer, expression + "=", [call_text(expression), f"{answer}<|im_end|>"],
                                         [str(answer)]))
    fit = fit_demonstrations(TINY, tokenizer, episodes, out / "model", steps=150)
    assert fit["loss_last"] < 0.5 * fit["loss_first"]
    write_parquet(task.rows(64, 0, "train"), out / "train.parquet")
    return out / "model", out / "train.parquet"


def test_multi_turn_grpo_with_a_calculator(tmp_path: Path, warm_model: tuple[Path, Path]) -> None:
    model, train = warm_model
    cfg = {
        "data": {"train_files": [str(train)], "tokenizer": str(model), "max_prompt_length": 32,
                 "max_response_length": 64, "train_batch_size": 4, "apply_chat_template": "true"},
        "model": {"path": str(model)},
        "actor": {"optim": {"lr": 1e-4, "weight_decay": 0.0}, "megatron": {"tensor_model_parallel_size": 2},
                  # two mini-batches: the old log-probs come from a pass of the actor (the gap metric below)
                  "ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 8},
        "rollout": {"engine": "hf", "n": 4,
                    "multi_turn": {"enable": True, "tools": ["calculator"], "max_turns": 3, "tool_timeout_s": 5.0}},
        "algorithm": {"adv_estimator": "grpo"},
        "reward": {"reward_kwargs": {"gsm8k": {"method": "flexible"}}},
        "trainer": {"total_training_steps": 2, "test_freq": -1, "save_freq": -1, "val_before_train": False,
                    "progress_bar": False, "default_local_dir": str(tmp_path / "run"),
                    "rollout_data_dir": str(tmp_path / "rollouts")},
        "resources": {"device": "cpu", "actor_pool": {"nnodes": 1, "devices_per_node": 2}},
        "tracking": {"backends": ["jsonl", "console"], "report_plots": False},
    }
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(config)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    if proc.returncode != 0:
        print(proc.stdout[-5000:], proc.stderr[-10000:])
    assert proc.returncode == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = {rec["step"]: rec["metrics"] for rec in map(json.loads, lines)}
    assert sorted(metrics) == [1, 2]
    for step in metrics.values():
        assert step["agent/turns/max"] >= 2 and step["agent/tool_calls/mean"] > 0  # multi-turn episodes happen
        assert step["agent/tool_reward/mean"] > 0
        assert step["reward/tool_reward_mean"] == pytest.approx(step["agent/tool_reward/mean"])
        assert step["agent/retokenize_mismatch"] == 0.0
        # The engine's log-probs line up with the trainer's on every model token of every turn.
        assert step["training/rollout_logprob_abs_diff_max"] < 1e-3
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    called = [r for r in rows if "<tool_call>" in r["output"]]
    assert called
    for r in rows:
        # `output` is the response under response_mask: the model's calls and answers are in it,
        # the tool-role turns (mask 0) are not.
        assert "<|im_start|>tool" not in r["output"]
        # The tool reward reaches the score next to the rule score.
        assert r["score"] == pytest.approx(r["reward_info/score"] + r["tool_reward"], abs=1e-6)
    assert any(r["tool_reward"] == 1.0 for r in called)
