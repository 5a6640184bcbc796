"""Step summaries of the benchmarks: warm-up excluded, phase shares, tokens/s and ratios, checked
against numbers worked out by hand; metrics are read from a file written by megarl's own tracker."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.unit


def _metrics(step_s: float, gen_s: float, update_s: float, reward_s: float, total: float, resp_len: float,
             score: float) -> dict[str, float]:
    return {"timing_s/step": step_s, "timing_s/gen": gen_s, "timing_s/update_actor": update_s,
            "timing_s/reward": reward_s, "perf/total_num_tokens": total, "response_length/mean": resp_len,
            "critic/score/mean": score}


def test_summary_from_a_metrics_file_written_by_the_tracker(tmp_path):
    from megarl_run import read_metrics, step_record, summarise_steps, with_wall_seconds

    from megarl.tracking.jsonl import JsonlWriter

    writer = JsonlWriter(tmp_path)
    # Written out of order on purpose: the reader sorts by step.
    # Lines logged at 110, 112.5 and 117.5 s: steps 2 and 3 took 2.5 s and 5 s of wall clock.
    writer.write(2, _metrics(2.0, 1.0, 0.5, 0.1, 16, 3.0, 0.5), timestamp=112.5)
    writer.write(1, _metrics(10.0, 5.0, 3.0, 1.0, 20, 2.0, 0.0), timestamp=110.0)
    writer.write(3, _metrics(4.0, 2.0, 1.5, 0.1, 24, 1.0, 1.0), timestamp=117.5)
    writer.close()

    records = with_wall_seconds([step_record(row, sequences=4) for row in read_metrics(tmp_path / "metrics.jsonl")])
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "wall_s" not in records[0] and [r["wall_s"] for r in records[1:]] == [2.5, 5.0]
    assert records[1]["response_tokens"] == 12.0  # 3 tokens on average x 4 sequences

    s = summarise_steps(records)
    # Steps 2 and 3 only (step 1 is warm-up): 6 s in all.
    assert s["timed_steps"] == 2
    assert s["step_s_mean"] == pytest.approx(3.0)
    assert s["wall_step_s_mean"] == pytest.approx(3.75)  # the step timers leave out 1.5 s
    assert s["generated_tokens_per_s"] == pytest.approx((12 + 4) / 6)
    assert s["training_tokens_per_s"] == pytest.approx((16 + 24) / 6)
    assert s["gen_phase_tokens_per_s"] == pytest.approx(16 / 3)
    assert s["phase_shares"]["gen"] == pytest.approx(3 / 6)
    assert s["phase_shares"]["update_actor"] == pytest.approx(2 / 6)
    assert s["phase_shares"]["reward"] == pytest.approx(0.2 / 6)
    assert s["phase_shares"]["other"] == pytest.approx(0.8 / 6)
    assert math.fsum(s["phase_shares"].values()) == pytest.approx(1.0)
    assert s["phase_seconds_mean"]["gen"] == pytest.approx(1.5)
    assert "old_log_prob" not in s["phase_shares"]  # a phase the run never timed is not invented
    assert s["biggest_phase"] == "gen"
    assert s["reward_first"] == 0.0
    assert s["reward_last_window_mean"] == pytest.approx(0.5)  # fewer steps than the window: all of them


def test_trl_summary_and_ratios():
    from e2e import compare, summarise_trl

    records = [
        {"step": 1, "step_s": 9.0, "wall_s": None, "gen_and_score_s": 8.0, "prompt_tokens": 32, "response_tokens": 64,
         "score_mean": 0.1},
        {"step": 2, "step_s": 0.5, "wall_s": 0.75, "gen_and_score_s": 0.2, "prompt_tokens": 32, "response_tokens": 48,
         "score_mean": 0.2},
        {"step": 3, "step_s": 1.5, "wall_s": 1.75, "gen_and_score_s": 0.3, "prompt_tokens": 32, "response_tokens": 16,
         "score_mean": 0.6},
    ]
    t = summarise_trl(records, reward_window=2)
    assert t["step_s_mean"] == pytest.approx(1.0)
    assert t["wall_step_s_mean"] == pytest.approx(1.25)
    assert t["generated_tokens_per_s"] == pytest.approx(64 / 2.0)
    assert t["training_tokens_per_s"] == pytest.approx((64 + 64) / 2.0)
    assert t["gen_and_score_share"] == pytest.approx(0.5 / 2.0)
    assert t["reward_last_window_mean"] == pytest.approx(0.4)

    megarl = {"summary": {"step_s_mean": 4.0, "wall_step_s_mean": 5.0, "generated_tokens_per_s": 8.0,
                          "training_tokens_per_s": 16.0, "reward_last_window_mean": 0.2},
              "memory": {"workload_mib": 3000.0}}
    trl = {"summary": t, "memory": {"workload_mib": 1000.0}}
    r = compare(megarl, trl)
    assert r["step_time"] == pytest.approx(4.0)
    assert r["wall_step_time"] == pytest.approx(4.0)  # 5.0 / 1.25
    assert r["generated_tokens_per_s"] == pytest.approx(8.0 / 32.0)
    assert r["training_tokens_per_s"] == pytest.approx(16.0 / 64.0)
    assert r["peak_memory_workload"] == pytest.approx(3.0)
    assert r["reward_last_window"] == pytest.approx(0.5)


def test_parameter_count_matches_the_model(tmp_path):
    import torch
    from common import parameter_count
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    assert parameter_count(tmp_path) == sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert parameter_count(tmp_path, skip=("embed_tokens.weight",)) == sum(p.numel() for p in model.parameters()) - embedding
    assert parameter_count(tmp_path / "missing") is None


def test_mfu_counts_six_flops_per_parameter_and_token():
    from gpu import mfu, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    # 0.5B parameters at 10k tokens/s: 6 x 5e8 x 1e4 = 3e13 FLOP/s, about 3% of an H100.
    assert mfu(500_000_000, 10_000.0, 989e12) == pytest.approx(3e13 / 989e12)
    assert peak_flops("Unknown Accelerator") is None
    assert mfu(1, 1.0, None) is None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_useful_mfu_of_the_e2e_comparison_by_hand(precision):
    """Steps 2..N only; megarl's update 6 x params x tokens over its seconds, TRL's training part the
    step minus generation and scoring; against the rate of the run's precision, named by it."""
    from e2e import useful_mfu

    megarl = {"records": [{"step": 1, "total_tokens": 999, "update_actor_s": 99.0},
                          {"step": 2, "total_tokens": 100, "update_actor_s": 2.0},
                          {"step": 3, "total_tokens": 300, "update_actor_s": 2.0}]}
    trl = {"records": [{"step": 1, "prompt_tokens": 9, "response_tokens": 9, "step_s": 99.0, "gen_and_score_s": 1.0},
                       {"step": 2, "prompt_tokens": 50, "response_tokens": 150, "step_s": 5.0, "gen_and_score_s": 3.0}]}
    # Three measurements of the rate; the MFU is against the best (a busy moment understates it).
    out = useful_mfu(megarl, trl, params=1000, rates=[0.5e6, 1e6, 0.8e6], precision=precision)
    assert out["mfu_precision"] == precision and out[f"matmul_{precision}_flops_per_s"] == 1e6
    assert out[f"matmul_{precision}_flops_per_s_measured"] == [0.5e6, 1e6, 0.8e6]
    assert out["megarl_update_mfu"] == pytest.approx(6 * 1000 * 400 / 4.0 / 1e6)  # 0.6
    assert out["trl_training_mfu"] == pytest.approx(6 * 1000 * 200 / 2.0 / 1e6)  # 0.6
    assert out["megarl_old_log_prob_mfu"] is None  # no old-log-prob pass ran
    with pytest.raises(ValueError, match="no matmul rate"):
        useful_mfu(megarl, trl, params=1000, rates=[], precision=precision)


def test_reward_against_wall_clock_over_the_span_both_sides_ran():
    from e2e import reward_vs_wall_clock

    # megarl: steps of 1 s end at 1, 2, 3, 4 s; TRL: steps of 0.5 s end at 0.5 .. 3.0 s. Both ran 3 s.
    megarl = [{"step": i + 1, "step_s": 1.0, "score_mean": s} for i, s in enumerate([0.3, 0.6, 0.9, 0.0])]
    trl = [{"step": i + 1, "step_s": 0.5, "score_mean": s} for i, s in enumerate([0.0, 0.0, 0.5, 0.5, 1.0, 1.0])]
    out = reward_vs_wall_clock(megarl, trl, windows=3)
    assert out["span_s"] == pytest.approx(3.0)
    assert out["window_edges_s"] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    # A step counts in the window its end falls in ([a, b), the last one closed); megarl's step 4
    # ended after TRL's last step and is left out.
    assert out["megarl_window_mean"][0] is None
    assert out["megarl_window_mean"][1:] == pytest.approx([0.3, (0.6 + 0.9) / 2])
    assert out["trl_window_mean"] == pytest.approx([0.0, 0.25, (0.5 + 1.0 + 1.0) / 3])
    assert (out["megarl_steps_in_span"], out["trl_steps_in_span"]) == (3, 6)
    assert out["megarl_mean_in_span"] == pytest.approx(0.6)
    assert out["trl_mean_in_span"] == pytest.approx(0.5)
    assert out["reward_ratio_at_equal_time"] == pytest.approx(1.2)


def test_reward_plot_against_wall_clock_is_written(tmp_path):
    from e2e import plot_reward_vs_wall_clock

    records = [{"step": i + 1, "step_s": 0.1, "score_mean": i / 20} for i in range(20)]
    path = plot_reward_vs_wall_clock(records, records[:10], tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trl_scores_with_the_megarl_runs_scorer_options(tmp_path):
    from e2e import megarl_reward_options
    from omegaconf import OmegaConf

    (tmp_path / "config.yaml").write_text("reward:\n  reward_kwargs:\n    arithmetic: {mode: startswith}\n")
    assert megarl_reward_options(OmegaConf.load(tmp_path / "config.yaml")) == {"arithmetic": {"mode": "startswith"}}
    # The two rules differ on this completion: the default one ("prefix") needs the whole leading number.
    from megarl.rewards.scorers import score_builtin

    assert score_builtin("arithmetic", "72", "7", options={"arithmetic": {"mode": "startswith"}})["score"] == 1.0
    assert score_builtin("arithmetic", "72", "7")["score"] == 0.0


def test_rounds_give_the_median_and_range_of_each_ratio():
    from e2e import summarise_rounds

    rounds = [{"step_time": 1.10, "generated_tokens_per_s": 0.9, "reward_ratio_at_equal_time": None},
              {"step_time": 0.95, "generated_tokens_per_s": 1.1, "reward_ratio_at_equal_time": 1.2},
              {"step_time": 0.99, "generated_tokens_per_s": 1.0, "reward_ratio_at_equal_time": 0.8}]
    out = summarise_rounds(rounds)
    assert out["rounds"] == 3
    assert out["step_time"] == {"median": 0.99, "min": 0.95, "max": 1.10}
    assert out["generated_tokens_per_s"] == {"median": 1.0, "min": 0.9, "max": 1.1}
    # A round without a reward ratio is left out: the median of two values is their mean.
    assert out["reward_ratio_at_equal_time"]["median"] == pytest.approx(1.0)


def test_the_reward_timeline_runs_on_wall_clock_where_a_record_has_it():
    from e2e import reward_timeline

    # Step 1 has no wall time (nothing before it): its step timer counts; then 1.5 s and 2.5 s.
    records = [{"step": 1, "step_s": 1.0, "score_mean": 0.1},
               {"step": 2, "step_s": 1.0, "wall_s": 1.5, "score_mean": None},
               {"step": 3, "step_s": 2.0, "wall_s": 2.5, "score_mean": 0.7}]
    assert reward_timeline(records) == [(1.0, 0.1), (5.0, 0.7)]


def test_reward_over_seeds_pools_the_rounds_over_the_span_every_run_covered():
    from e2e import reward_over_seeds

    def steps(seconds: float, scores: list[float]) -> list[dict]:
        return [{"step": i + 1, "step_s": seconds, "score_mean": s} for i, s in enumerate(scores)]

    # Seed 1: megarl's steps end at 1, 2, 3 s, TRL's at 1.5, 3.0 s; seed 2: megarl's at 1, 2, 3, 4 s,
    # TRL's at 1, 2, 3 s. The shortest run covers 3 s: megarl's step at 4 s is left out.
    pairs = [(1, steps(1.0, [0.0, 0.5, 1.0]), steps(1.5, [0.2, 0.4])),
             (2, steps(1.0, [0.1, 0.1, 0.4, 1.0]), steps(1.0, [0.0, 0.3, 0.3]))]
    out = reward_over_seeds(pairs, windows=3)
    assert out["seeds"] == [1, 2]
    assert out["span_s"] == pytest.approx(3.0)
    assert out["window_edges_s"] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    # Windows [0, 1), [1, 2), [2, 3]: megarl's steps at 1, 2, 3 s of both seeds fall in windows 1, 2, 2.
    assert out["megarl_window_mean"][0] is None
    assert out["megarl_window_mean"][1:] == pytest.approx([(0.0 + 0.1) / 2, (0.5 + 1.0 + 0.1 + 0.4) / 4])
    # TRL: seed 1 at 1.5 s (window 1) and 3.0 s (window 2); seed 2 at 1, 2, 3 s (windows 1, 2, 2).
    assert out["trl_window_mean"][1:] == pytest.approx([(0.2 + 0.0) / 2, (0.4 + 0.3 + 0.3) / 3])
    per_seed = {r["seed"]: r for r in out["per_seed"]}
    assert per_seed[1]["megarl_mean_in_span"] == pytest.approx(0.5)
    assert per_seed[1]["trl_mean_in_span"] == pytest.approx(0.3)
    assert per_seed[2]["megarl_mean_in_span"] == pytest.approx(0.2)
    assert per_seed[2]["trl_mean_in_span"] == pytest.approx(0.2)
    assert [per_seed[1]["difference"], per_seed[2]["difference"]] == pytest.approx([0.2, 0.0])
    assert out["difference_mean"] == pytest.approx(0.1)
    # Sample standard deviation of (0.2, 0.0) is 0.2 / sqrt(2); over sqrt(2) seeds: 0.1.
    assert out["difference_standard_error"] == pytest.approx(0.1)
    assert out["megarl_mean_in_span"] == pytest.approx(0.35)
    assert out["trl_mean_in_span"] == pytest.approx(0.25)
    assert out["reward_ratio_at_equal_time"] == pytest.approx(1.4)
    # One seed: no standard error.
    assert reward_over_seeds(pairs[:1], windows=3)["difference_standard_error"] is None
    assert "error" in reward_over_seeds([(1, steps(1.0, [0.5]), [])])


def test_seeds_option_one_round_per_distinct_seed(tmp_path):
    import argparse

    from e2e import main, parse_seeds, seed_overrides

    assert parse_seeds("3,1,2") == [3, 1, 2]
    for bad in ("1,,2", "a", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_seeds(bad)
    assert seed_overrides(7) == ["trainer.seed=7", "data.seed=7"]
    assert seed_overrides(None) == []
    # --rounds that disagrees with the number of seeds is refused before anything runs.
    with pytest.raises(SystemExit) as err:
        main(["--seeds", "1,2,3", "--rounds", "2", "--work-dir", str(tmp_path)])
    assert err.value.code == 2
    assert not any(tmp_path.iterdir())


def test_reward_plot_over_seeds_is_written(tmp_path):
    from e2e import plot_reward_over_seeds

    records = [{"step": i + 1, "step_s": 0.1, "score_mean": i / 20} for i in range(20)]
    path = plot_reward_over_seeds([(1, records, records[:15]), (2, records[:12], records)], tmp_path / "seeds.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_useful_mfu_counts_the_tokens_the_update_ran():
    """With rows of zero advantage left out (actor.skip_zero_advantage_rows) the update's FLOPs are
    those of the tokens it ran; the old-log-prob pass counts the tokens it computed (all of them
    unless it ran after the advantages: old_log_prob_tokens_skipped)."""
    from e2e import useful_mfu

    megarl = {"records": [{"step": 1, "total_tokens": 999, "update_actor_s": 99.0},
                          {"step": 2, "total_tokens": 100, "update_actor_s": 2.0, "old_log_prob_s": 1.0,
                           "update_rows_skipped": 0.5, "update_tokens_skipped": 0.25},
                          {"step": 3, "total_tokens": 300, "update_actor_s": 2.0, "old_log_prob_s": 1.0,
                           "update_rows_skipped": 0.0, "update_tokens_skipped": 0.0},
                          {"step": 4, "total_tokens": 200, "update_actor_s": 2.0, "old_log_prob_s": 1.0,
                           "update_rows_skipped": 0.5, "update_tokens_skipped": 0.5,
                           "old_log_prob_tokens_skipped": 0.6}]}
    trl = {"records": [{"step": 2, "prompt_tokens": 50, "response_tokens": 150, "step_s": 5.0, "gen_and_score_s": 3.0}]}
    out = useful_mfu(megarl, trl, params=1000, rates=[1e6])
    assert out["megarl_update_tokens_per_step"] == pytest.approx((75 + 300 + 100) / 3)
    assert out["megarl_update_mfu"] == pytest.approx(6 * 1000 * 475 / 6.0 / 1e6)
    assert out["megarl_old_log_prob_mfu"] == pytest.approx(2 * 1000 * (100 + 300 + 80) / 3.0 / 1e6)
    assert out["megarl_update_rows_skipped_mean"] == pytest.approx(1.0 / 3)
