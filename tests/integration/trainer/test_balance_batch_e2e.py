"""`megarl train` at DP=2 with and without `trainer.balance_batch`: the balanced run logs verl's
`global_seqlen/*`, trains like the unbalanced one, and dumps its rollouts in the rollout order.

Equal training needs a loss that does not depend on which rank holds a row: token-mean over the
mini-batch (global token count all-reduced over DP), one mini-batch per step, one epoch. Then the
gradient is the same sum in another order, so `actor/grad_norm` agrees to fp32 rounding. The
per-rank metrics (`actor/pg_loss`, `actor/entropy`) are DP rank 0's shard only (`call_dp(...)[0]`),
which balancing changes by design: they are not compared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_e2e import MIXED_REWARD, read_metrics, run_train, write_config

pytestmark = pytest.mark.integration

# Two fp32 computations of one gradient (tests/distributed/engine_helpers.GRAD_RTOL).
RTOL = 2e-5
SEQLEN = ("min", "max", "minmax_diff", "balanced_min", "balanced_max", "mean")


@pytest.fixture(scope="module")
def varied_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prompts of 4 to 6 characters (operands 0..19), so the rollout order leaves the DP shards uneven."""
    out = tmp_path_factory.mktemp("arith_varied")
    subprocess.run([sys.executable, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(out),
                    "--tokenizer-out", str(out / "tokenizer"), "--num-operands", "2", "--min-value", "0",
                    "--max-value", "19", "--operators", "+", "--train-size", "64", "--val-size", "8"],
                   check=True, capture_output=True, text=True)
    return out


def test_balanced_run_trains_like_unbalanced(tmp_path: Path, varied_task: Path) -> None:
    runs, dumps = {}, {}
    for balance in ("true", "false"):
        out = tmp_path / balance
        out.mkdir()
        # A fresh model scores 0 everywhere (advantages 0): the entropy bonus gives the gradient.
        # trainer.seed 4: its responses leave the shards uneven enough for balancing to help (with
        # groups of 4 kept together on 2 ranks, some samples allow no better split).
        config = write_config(out, varied_task,
                              actor={"megatron": {"tensor_model_parallel_size": 1}, "entropy_coeff": 0.01},
                              trainer={"rollout_data_dir": str(out / "rollouts"), "seed": 4})
        proc = run_train(config, f"trainer.balance_batch={balance}")
        assert proc.returncode == 0
        runs[balance] = read_metrics(out / "run")
        dumps[balance] = [json.loads(line) for line in (out / "rollouts" / "1.jsonl").read_text().splitlines()]
    on, off = runs["true"], runs["false"]
    # uneven before, closer after (on this seed's prompts)
    assert any(on[s]["global_seqlen/balanced_max"] - on[s]["global_seqlen/balanced_min"]
               < on[s]["global_seqlen/minmax_diff"] for s in (1, 2))
    for step in (1, 2):
        m = on[step]
        seqlen = {k: m[f"global_seqlen/{k}"] for k in SEQLEN}
        assert seqlen["minmax_diff"] == seqlen["max"] - seqlen["min"]
        assert seqlen["balanced_max"] - seqlen["balanced_min"] <= seqlen["minmax_diff"]
        assert seqlen["balanced_min"] <= seqlen["mean"] <= seqlen["balanced_max"]
        # 16 rows over 2 ranks: the mean is half the batch's tokens (prompt + response)
        assert 2 * seqlen["mean"] == pytest.approx(
            16 * (m["prompt_length/mean"] + m["response_length/mean"]))
        assert not any(k.startswith("global_seqlen/") for k in off[step])
        # the same responses (step 2: sampled from weights equal up to fp32 rounding), the same update
        for key in ("critic/score/mean", "response_length/mean"):
            assert m[key] == off[step][key], key
        assert m["actor/grad_norm"] > 0
        assert m["actor/grad_norm"] == pytest.approx(off[step]["actor/grad_norm"], rel=RTOL)
    # the dump keeps the rollout order: row by row the same prompts, responses and scores
    assert [(r["uid"], r["input"], r["output"], r["score"]) for r in dumps["true"]] == \
        [(r["uid"], r["input"], r["output"], r["score"]) for r in dumps["false"]]
    assert [r["advantage"] for r in dumps["true"]] == pytest.approx([r["advantage"] for r in dumps["false"]],
                                                                    abs=1e-6)


def runs_with_and_without_skipping(tmp_path: Path, task: Path, actor: dict, trainer: dict) -> tuple[dict, dict]:
    """The metrics of two 2-step runs at DP=2, actor.skip_zero_advantage_rows true and false, with a
    reward that gives the groups of even answers 0 (their rows have zero advantage) and the others a
    signal; `actor` and `trainer` sections over the common ones."""
    runs = {}
    for skip in ("true", "false"):
        out = tmp_path / skip
        out.mkdir()
        reward_file = out / "mixed_reward.py"
        reward_file.write_text(MIXED_REWARD)
        config = write_config(out, task, actor={"megatron": {"tensor_model_parallel_size": 1}, **actor},
                              reward={"custom_reward_function": {"path": str(reward_file)}},
                              trainer={"seed": 4, **trainer})
        proc = run_train(config, f"actor.skip_zero_advantage_rows={skip}")
        assert proc.returncode == 0
        runs[skip] = read_metrics(out / "run")
    return runs["true"], runs["false"]


def test_skipping_zero_advantage_rows_trains_like_running_them(tmp_path: Path, varied_task: Path) -> None:
    """actor.skip_zero_advantage_rows at DP=2 (no entropy bonus, no pass before the update): the same
    updates as running every row, and the balance counts the tokens of the rows the update runs."""
    on, off = runs_with_and_without_skipping(tmp_path, varied_task, actor={}, trainer={})
    assert any(on[s]["actor/zero_advantage_rows_skipped"] > 0 for s in (1, 2))
    for step in (1, 2):
        m = on[step]
        assert "actor/zero_advantage_rows_skipped" not in off[step]
        for key in ("critic/score/mean", "response_length/mean"):
            assert m[key] == off[step][key], key
        assert m["actor/grad_norm"] > 0
        assert m["actor/grad_norm"] == pytest.approx(off[step]["actor/grad_norm"], rel=RTOL)
        assert m["actor/loss"] == pytest.approx(off[step]["actor/loss"], rel=RTOL, abs=1e-7)
        # Balanced by the tokens the update runs: fewer than the batch's when it skips rows.
        every_token = 16 * (m["prompt_length/mean"] + m["response_length/mean"])
        assert 2 * off[step]["global_seqlen/mean"] == pytest.approx(every_token)
        if m["actor/zero_advantage_rows_skipped"] > 0:
            assert 2 * m["global_seqlen/mean"] < every_token


def test_old_log_prob_pass_computes_only_the_rows_the_update_runs(tmp_path: Path, varied_task: Path) -> None:
    """Two mini-batches a step (old log-probs recomputed) with actor.skip_zero_advantage_rows: the
    advantages come first and the pass computes only the rows of nonzero advantage; the updates are
    those of the run computing every row. trainer.balance_batch off on both sides: balancing after the
    advantages orders the rows otherwise, and so fills the mini-batches otherwise."""
    on, off = runs_with_and_without_skipping(tmp_path, varied_task,
                                             actor={"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4},
                                             trainer={"balance_batch": False})
    assert any(on[s]["training/old_log_prob_rows_skipped"] > 0 for s in (1, 2))
    for s in (1, 2):
        assert (on[s]["training/old_log_prob_tokens_skipped"] > 0) == (on[s]["training/old_log_prob_rows_skipped"] > 0)
    # A rank's mini-batch without a row of nonzero advantage ran one anyway, on its own log-probs:
    # the update ran more rows than the pass computed.
    assert any(on[s]["actor/zero_advantage_rows_skipped"] < on[s]["training/old_log_prob_rows_skipped"]
               for s in (1, 2))
    for step in (1, 2):
        m = on[step]
        assert m["training/old_log_prob_source"] == off[step]["training/old_log_prob_source"] == 0  # recompute
        assert "training/old_log_prob_rows_skipped" not in off[step]
        # The scores come before the pass (it needs the advantages), beside it with the key off.
        assert (m["training/reward_overlapped"], off[step]["training/reward_overlapped"]) == (0.0, 1.0)
        for key in ("critic/score/mean", "response_length/mean"):
            assert m[key] == off[step][key], key
        assert m["actor/grad_norm"] > 0
        assert m["actor/grad_norm"] == pytest.approx(off[step]["actor/grad_norm"], rel=RTOL)
        assert m["actor/loss"] == pytest.approx(off[step]["actor/loss"], rel=RTOL, abs=1e-7)
        # The rollout-vs-trainer gap over the rows computed: the same weights, fp32 rounding apart.
        assert m["training/rollout_logprob_abs_diff_mean"] < 1e-4
