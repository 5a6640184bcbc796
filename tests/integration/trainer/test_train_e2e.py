"""End-to-end runs of `megarl train` on a local Ray cluster: GRPO, PPO with a critic, DAPO with
dynamic sampling, learning, kill-and-resume, and a bad config refused before Ray starts."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]

TINY = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    subprocess.run(
        [sys.executable, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(out),
         "--tokenizer-out", str(out / "tokenizer"), "--num-operands", "2", "--min-value", "0",
         "--max-value", "4", "--operators", "+",
         "--train-size", "400", "--val-size", "32"],
        check=True, capture_output=True, text=True,
    )
    return out


def write_config(tmp: Path, task: Path, **sections: dict) -> Path:
    cfg = {
        "data": {"train_files": [str(task / "train.parquet")], "val_files": [str(task / "val.parquet")],
                 "tokenizer": str(task / "tokenizer"), "max_prompt_length": 8, "max_response_length": 4,
                 "train_batch_size": 4, "apply_chat_template": "false"},
        # A copy: the merge below updates nested dicts in place, and TINY is shared by every test
        # of the process (a MoE hf_config merged into it once made every later run a MoE run).
        "model": {"init_from_scratch": True, "hf_config": dict(TINY)},
        "actor": {"optim": {"lr": 1e-4, "weight_decay": 0.0}, "megatron": {"tensor_model_parallel_size": 2},
                  "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8},
        "rollout": {"engine": "hf", "n": 4},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": 2, "test_freq": -1, "save_freq": -1, "val_before_train": False,
                    "progress_bar": False, "default_local_dir": str(tmp / "run")},
        "resources": {"device": "cpu", "actor_pool": {"nnodes": 1, "devices_per_node": 2}},
        # Plots cost a few seconds of every run's end: test_grpo_runs_and_logs_verl_metrics and
        # test_disk_full_save draw them.
        "tracking": {"backends": ["jsonl", "console"], "report_plots": False},
    }
    for section, values in sections.items():
        _deep_update(cfg.setdefault(section, {}), values)
    path = tmp / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _deep_update(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value


def run_train(config: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(config), *overrides],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=config.parent)
    if proc.returncode != 0:
        print(proc.stdout[-5000:], proc.stderr[-10000:])
    return proc


def read_metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec["metrics"] for rec in map(json.loads, lines)}


def test_grpo_runs_and_logs_verl_metrics(tmp_path: Path, task_dir: Path) -> None:
    config = write_config(tmp_path, task_dir, actor={"use_kl_loss": True, "kl_loss_coef": 0.01},
                          trainer={"rollout_data_dir": str(tmp_path / "rollouts"), "profile_steps": [2],
                                   "validation_data_dir": str(tmp_path / "val_generations")})
    proc = run_train(config, "tracking.backends=[jsonl,console,mlflow]", "rollout.sync_verify_freq=2",
                     "tracking.report_plots=true")
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2]
    # rollout.sync_verify_freq=2: the first weight sync is verified piece by piece, the second not
    assert metrics[1]["sync/pieces_verified"] > 0 and metrics[2]["sync/pieces_verified"] == 0
    assert 0 < metrics[1]["sync/verify_s"] < metrics[1]["sync/seconds_max"] and metrics[2]["sync/verify_s"] == 0
    step = metrics[2]
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                "actor/kl_loss", "critic/score/mean", "response_length/mean", "response_length/clip_ratio",
                "timing_s/gen", "timing_s/update_actor", "timing_s/ref", "perf/throughput"):
        assert key in step, f"{key} missing from {sorted(step)}"
        assert math.isfinite(step[key])
    assert (tmp_path / "run" / "mlflow.db").is_file()
    assert (tmp_path / "run" / "report" / "summary.md").is_file()
    assert (tmp_path / "run" / "report" / "reward.png").stat().st_size > 0
    # trainer.rollout_data_dir: one JSONL per step, a line per response (4 prompts x rollout.n 4)
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {"input", "output", "score", "advantage", "uid"} <= set(rows[0])
    assert sum(r["score"] for r in rows) / 16 == pytest.approx(step["critic/score/mean"], abs=1e-6)
    assert (tmp_path / "val_generations" / "2.jsonl").is_file()  # validation at the last step
    # trainer.profile_steps: a Chrome trace of step 2 from each of the 2 worker processes
    traces = sorted((tmp_path / "run" / "profile" / "step_2").glob("*.json"))
    assert [t.name for t in traces] == ["hybrid_actor_rank0.json", "hybrid_actor_rank1.json"]
    assert json.loads(traces[0].read_text())["traceEvents"]
    assert not (tmp_path / "run" / "profile" / "step_1").exists()


def read_memory_trace(run_dir: Path, with_val: bool = False) -> dict[int, list[tuple[str, str, str]]]:
    """Each step's memory transitions; those of the validation after it (phase "val") only `with_val`."""
    lines = (run_dir / "memory_phases.jsonl").read_text().splitlines()
    return {rec["step"]: [tuple(t) for t in rec["transitions"] if with_val or t[0] != "val"]
            for rec in map(json.loads, lines)}


SYNC_AND_GEN = [("sync_weights", "rollout", "wake_up:weights"), ("sync_weights", "rollout", "wake_up"),
                ("gen", "rollout", "sleep")]
OFFLOAD_CASES = {
    # Every offload key is on in one of the two cases, and each case offloads a different subset of
    # the actor's state. GRPO with a KL loss: actor parameters and gradients, the reference.
    # (old_log_prob_source recompute: the old-log-prob pass runs, so its onload is traced too.)
    "grpo": (dict(actor={"use_kl_loss": True, "kl_loss_coef": 0.01, "old_log_prob_source": "recompute"}),
             dict(actor={"param_offload": True, "grad_offload": True}, ref={"param_offload": True}),
             ("actor/kl_loss",), ["sync_weights:actor:params", "old_log_prob:actor:params", "ref:ref:params",
                                  "update_actor:actor"]),
    # PPO with a colocated critic: the actor's optimizer state only, the critic's parameters and
    # optimizer; the resident run's rollout never sleeps either (rollout.free_cache_engine false).
    "ppo": (dict(algorithm={"adv_estimator": "gae", "lam": 0.95}, rollout={"n": 1, "free_cache_engine": False},
                 actor={"ppo_micro_batch_size_per_gpu": 2},
                 critic={"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2}),
            dict(actor={"optimizer_offload": True}, critic={"param_offload": True, "optimizer_offload": True},
                 rollout={"free_cache_engine": True}),
            ("critic/vf_loss", "critic/values/mean"),
            # the actor's parameters stay resident: the sync and its log-probs move nothing of it
            ["values:critic:params", "update_critic:critic", "update_actor:actor"]),
}


@pytest.mark.parametrize("algorithm", sorted(OFFLOAD_CASES))
def test_offloaded_roles_train_exactly_like_resident_ones(tmp_path: Path, task_dir: Path, algorithm: str) -> None:
    """Memory phases: with *_offload keys on, the roles live in host memory between the phases that
    use them, the rollout engine sleeps after generation, and the run's numbers are bit-identical to
    a run that keeps everything resident (same seed)."""
    base, offload, extra_keys, onloads = OFFLOAD_CASES[algorithm]
    resident_dir, offload_dir = tmp_path / "resident", tmp_path / "offload"
    resident_dir.mkdir()
    offload_dir.mkdir()
    assert run_train(write_config(resident_dir, task_dir, **base)).returncode == 0
    sections = {k: {**base.get(k, {}), **v} for k, v in offload.items()}
    assert run_train(write_config(offload_dir, task_dir, **{**base, **sections})).returncode == 0
    want, got = read_metrics(resident_dir / "run"), read_metrics(offload_dir / "run")
    for step in (1, 2):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", *extra_keys):
            assert got[step][key] == want[step][key], (step, key)
    # The order of the transitions in a steady step (step 2): each offloaded role comes in for its
    # phase and goes out after it; the rollout wakes its weights, syncs, wakes its cache, sleeps.
    # A rollout that never sleeps is sent no sleep and no wake-ups at all.
    resident_sleeps = base.get("rollout", {}).get("free_cache_engine", True)
    assert read_memory_trace(resident_dir / "run")[2] == (SYNC_AND_GEN if resident_sleeps else [])
    # The driver's calls to the 2 worker processes: each onloaded phase adds an onload and an
    # offload to both ranks, a rollout that sleeps a sleep and two wake-ups to both.
    added = 2 * (2 * len(onloads) + (0 if resident_sleeps else 3))
    calls = got[2]["perf/worker_calls"], want[2]["perf/worker_calls"]
    assert calls[0] - calls[1] == added, calls
    expected = [] if onloads[0].startswith("sync_weights") else list(SYNC_AND_GEN)
    for phase_role in onloads:
        phase, role, *params = phase_role.split(":")
        onload = (phase, role, "onload:params" if params else "onload")
        if phase == "sync_weights":
            expected += [onload, SYNC_AND_GEN[0], (phase, role, "offload"), *SYNC_AND_GEN[1:]]
        else:
            expected += [onload, (phase, role, "offload")]
    assert read_memory_trace(offload_dir / "run")[2] == expected
    assert "memory/update_actor/peak_rss_gb" in got[2] and "perf/cpu_memory_used_gb" in got[2]
    # A phase that ran on the driver alone sends the workers no memory probe (the next probed
    # phase's peak covers its span).
    assert not [k for k in got[2] if k.startswith("memory/adv/")], sorted(k for k in got[2] if k.startswith("memory/"))


GRPO_KL = dict(actor={"use_kl_loss": True, "kl_loss_coef": 0.01, "old_log_prob_source": "recompute"})
PPO_CRITIC = OFFLOAD_CASES["ppo"][0]
WAKE_SYNC_WAKE = [("sync_weights", "rollout", "wake_up:weights"), ("sync_weights", "rollout", "wake_up")]


def around(phase: str, role: str, onload: str = "onload") -> list[tuple[str, str, str]]:
    return [(phase, role, onload), (phase, role, "offload")]


# One key at a time: the transitions of a steady step (step 2), written out by hand (with every key
# off the trace is SYNC_AND_GEN, checked above). Offloaded parameters come in for each forward pass
# (the weight sync reads them, the log-probs and values compute with them) and for the update;
# offloaded gradients or optimizer state only for the update. The reference and the critic come in
# for their own phases only. Without free_cache_engine the rollout never sleeps, so nothing is
# woken either.
SINGLE_KEY_TRACES = {
    "grpo-actor.param_offload": (GRPO_KL, {"actor": {"param_offload": True}}, [
        ("sync_weights", "actor", "onload:params"), WAKE_SYNC_WAKE[0], ("sync_weights", "actor", "offload"),
        WAKE_SYNC_WAKE[1], ("gen", "rollout", "sleep"), *around("old_log_prob", "actor", "onload:params"),
        *around("update_actor", "actor")]),
    **{f"grpo-actor.{key}": (GRPO_KL, {"actor": {key: True}}, [
        *WAKE_SYNC_WAKE, ("gen", "rollout", "sleep"), *around("update_actor", "actor")])
       for key in ("grad_offload", "optimizer_offload")},
    "grpo-ref.param_offload": (GRPO_KL, {"ref": {"param_offload": True}},
                               [*WAKE_SYNC_WAKE, ("gen", "rollout", "sleep"), *around("ref", "ref", "onload:params")]),
    "grpo-rollout.free_cache_engine=false": (GRPO_KL, {"rollout": {"free_cache_engine": False}}, []),
    # The PPO case's rollout never sleeps (rollout.free_cache_engine false in its base).
    "ppo-critic.param_offload": (PPO_CRITIC, {"critic": {"param_offload": True}}, [
        *around("values", "critic", "onload:params"), *around("update_critic", "critic")]),
    "ppo-critic.optimizer_offload": (PPO_CRITIC, {"critic": {"optimizer_offload": True}}, [
        *around("update_critic", "critic")]),
}


# `make test-slow` (seven runs of about a minute on a slow 2-core machine): in `make test`,
# test_offloaded_roles_train_exactly_like_resident_ones checks the exact trace with every key on.
@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SINGLE_KEY_TRACES))
def test_memory_phase_trace_of_each_key_alone(tmp_path: Path, task_dir: Path, case: str) -> None:
    """Each offload/sleep key on its own moves exactly its role, in exactly its phases."""
    base, key, expected = SINGLE_KEY_TRACES[case]
    sections = {s: {**base.get(s, {}), **key.get(s, {})} for s in {*base, *key}}
    assert run_train(write_config(tmp_path, task_dir, **sections)).returncode == 0
    trace = read_memory_trace(tmp_path / "run")
    assert trace[2] == expected, trace[2]
    # Step 1 starts from engines that are awake and roles that init_model left offloaded.
    assert all(t[2] != "wake_up:weights" for t in trace[1])


def test_validation_and_checkpoint_time_is_logged_with_the_step_they_follow(tmp_path: Path, task_dir: Path) -> None:
    """Validation after step 2 (and its generation) and the checkpoint saved after it are step 2's
    `timing_s/val` and `timing_s/save_checkpoint`; before, they were popped with step 3's phases
    (step 3 carried `timing_s/val` and the validation's generation in its `timing_s/gen`), and a
    checkpoint step dropped the validation's time."""
    config = write_config(tmp_path, task_dir, trainer={"total_training_steps": 4, "test_freq": 2, "save_freq": 2})
    assert run_train(config).returncode == 0
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2, 3, 4]
    for step in (2, 4):
        assert metrics[step]["timing_s/val"] > 0 and metrics[step]["timing_s/save_checkpoint"] > 0, step
        assert any(key.startswith("memory/val/") for key in metrics[step]), step
    for step in (1, 3):
        assert not any(k.startswith("memory/val/") or k in ("timing_s/val", "timing_s/save_checkpoint")
                       for k in metrics[step]), (step, sorted(metrics[step]))
    # the steps' phases stay within the step: the validation's generation is not in step 3's
    assert metrics[3]["timing_s/gen"] < metrics[3]["timing_s/step"]
    # and the rollout's sleep after the validation is in step 2's line of memory_phases.jsonl, not step 3's
    trace = read_memory_trace(tmp_path / "run", with_val=True)
    assert {1, 2, 3, 4} <= set(trace)
    for step in (2, 4):  # the validation's weight sync and its sleep, after the step's own transitions
        assert trace[step][-3:] == [("val", "rollout", "wake_up:weights"), ("val", "rollout", "wake_up"),
                                    ("val", "rollout", "sleep")], (step, trace[step])
    for step in (1, 3):
        assert all(t[0] != "val" for t in trace[step]), (step, trace[step])


def test_val_only_validates_and_stops(tmp_path: Path, task_dir: Path) -> None:
    config = write_config(tmp_path, task_dir, trainer={"val_only": True})
    proc = run_train(config)
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [0] and "val/reward_mean" in metrics[0]


def test_ppo_with_critic_in_its_own_pool_and_kl_in_reward(tmp_path: Path, task_dir: Path) -> None:
    config = write_config(
        tmp_path, task_dir,
        algorithm={"adv_estimator": "gae", "use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05},
                   "gamma": 1.0, "lam": 0.95},
        critic={"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 4},
        rollout={"n": 1},
        actor={"ppo_micro_batch_size_per_gpu": 2},
        trainer={"critic_warmup": 1},
        resources={"critic_pool": {"nnodes": 1, "devices_per_node": 2}},  # split placement
    )
    proc = run_train(config)
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    assert "critic/vf_loss" in metrics[1] and "critic/values/mean" in metrics[1]
    assert "actor/pg_loss" not in metrics[1], "the actor must not train during the critic warm-up"
    assert "actor/pg_loss" in metrics[2]
    # the coefficient each step's rewards took: the initial one at step 1 (logged before the adaptive
    # controller moves it), at step 2 the one step 1's update gave
    assert metrics[1]["actor/reward_kl_penalty_coeff"] == 0.05
    assert metrics[2]["actor/reward_kl_penalty_coeff"] != 0.05


MIXED_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Prompts with an even answer always score 0 (their groups carry no signal and must be
    # filtered); the others score by the parity of the response length (signal in most groups).
    if int(ground_truth) % 2 == 0:
        return {"score": 0.0, "acc": 0.0}
    value = float(len(solution_str) % 2)
    return {"score": value, "acc": value}
"""


def test_dapo_dynamic_sampling_fills_the_batch(tmp_path: Path, task_dir: Path) -> None:
    reward_file = tmp_path / "mixed_reward.py"
    reward_file.write_text(MIXED_REWARD)
    config = write_config(
        tmp_path, task_dir,
        algorithm={"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 20}},
        actor={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},
        reward={"custom_reward_function": {"path": str(reward_file)},
                "overlong_buffer": {"enable": True, "len": 2, "penalty_factor": 0.5}},
        rollout={"n": 4},
        trainer={"total_training_steps": 2},
    )
    proc = run_train(config)
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    for step in (1, 2):
        assert metrics[step]["dapo/num_prompts_kept"] >= 4, metrics[step]
    # About half the groups are filtered, so filling 4 prompts from batches of 4 takes more than one.
    assert max(metrics[s]["train/num_gen_batches"] for s in (1, 2)) >= 2


def test_dapo_generation_batches_and_the_run_ends_with_its_epochs(tmp_path: Path) -> None:
    """data.gen_batch_size prompts per generation round; with total_training_steps null the run ends
    once the epochs' data is used, however many steps that took (verl's DAPO)."""
    task = tmp_path / "small"
    subprocess.run([sys.executable, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(task),
                    "--tokenizer-out", str(task / "tokenizer"), "--num-operands", "2", "--min-value", "0",
                    "--max-value", "4", "--operators", "+", "--train-size", "24", "--val-size", "4"],
                   check=True, capture_output=True, text=True)
    reward_file = tmp_path / "mixed_reward.py"
    reward_file.write_text(MIXED_REWARD)
    config = write_config(
        tmp_path, task,
        data={"gen_batch_size": 8},
        algorithm={"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 20}},
        reward={"custom_reward_function": {"path": str(reward_file)}},
        trainer={"total_training_steps": None, "total_epochs": 1},
    )
    proc = run_train(config)
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    steps = sorted(metrics)
    rounds = [metrics[s]["train/num_gen_batches"] for s in steps]
    assert all(metrics[s]["dapo/num_prompts_kept"] >= 4 for s in steps)
    # 24 prompts / 8 per round = 3 rounds an epoch: the last step began with data left and ended without.
    assert sum(rounds) >= 3 and sum(rounds) - rounds[-1] < 3, rounds
    assert len(steps) < 3 or rounds == [1, 1, 1], rounds
    # training/epoch: the epoch of the step's last generation batch (the last step's may be the next one)
    ends = list(itertools.accumulate(rounds))
    assert [metrics[s]["training/epoch"] for s in steps] == [(end - 1) // 3 for end in ends], (rounds, metrics)


def test_dapo_cap_is_a_clear_error(tmp_path: Path, task_dir: Path) -> None:
    reward_file = tmp_path / "constant_reward.py"
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    config = write_config(
        tmp_path, task_dir,
        algorithm={"filter_groups": {"enable": True, "metric": "seq_final_reward", "max_num_gen_batches": 2}},
        reward={"custom_reward_function": {"path": str(reward_file)}},
        trainer={"total_training_steps": 1},
    )
    proc = run_train(config)
    assert proc.returncode == 1
    assert "max_num_gen_batches" in proc.stderr and "2 generation batches" in proc.stderr, proc.stderr[-2000:]


def test_bad_config_is_refused_before_ray_starts(tmp_path: Path, task_dir: Path) -> None:
    config = write_config(tmp_path, task_dir, rollout={"n": 1})
    start = time.monotonic()
    proc = run_train(config)
    assert proc.returncode == 1
    assert "rollout.n = 1" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written for a refused config"
    assert time.monotonic() - start < 60


def test_killed_run_resumes_with_the_same_metrics(tmp_path: Path, task_dir: Path) -> None:
    common = ("trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=3")
    straight = tmp_path / "straight"
    straight.mkdir()
    assert run_train(write_config(straight, task_dir), *common).returncode == 0
    expected = read_metrics(straight / "run")

    killed = tmp_path / "killed"
    killed.mkdir()
    config = write_config(killed, task_dir)
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", str(config), *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=killed, start_new_session=True)
    marker = killed / "run" / "checkpoints" / "global_step_2" / "COMPLETE"
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert marker.exists(), "the run never wrote its step-2 checkpoint"

    assert run_train(config, *common).returncode == 0
    resumed = read_metrics(killed / "run")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_plain_optimizer_run_resumes_with_the_same_metrics(tmp_path: Path, task_dir: Path) -> None:
    """The quickstart's layout (DP=2, actor.optim.use_distributed_optimizer=false: Adam state on every
    rank): a run that ended after saving step 2, rerun with one more step, continues from step 2 as
    if it had never stopped (`make demo` twice)."""
    sections = {"actor": {"optim": {"use_distributed_optimizer": False}, "megatron": {"tensor_model_parallel_size": 1}}}
    straight = tmp_path / "straight"
    straight.mkdir()
    assert run_train(write_config(straight, task_dir, **sections), "trainer.total_training_steps=3").returncode == 0
    expected = read_metrics(straight / "run")

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    config = write_config(stopped, task_dir, **sections)
    assert run_train(config, "trainer.total_training_steps=2", "trainer.save_freq=2").returncode == 0
    assert (stopped / "run" / "checkpoints" / "global_step_2" / "COMPLETE").exists()
    # The distributed optimizer's state holds other tensors: refused before anything is written.
    before = sorted(p.relative_to(stopped) for p in stopped.rglob("*"))
    other = run_train(config, "trainer.total_training_steps=3", "trainer.save_freq=2",
                      "actor.optim.use_distributed_optimizer=true")
    assert other.returncode == 1
    assert ("its actor was saved with the plain fp32 optimizer (use_distributed_optimizer=false, fp32), this run "
            "would build the distributed optimizer (use_distributed_optimizer=true) "
            "(actor.optim.use_distributed_optimizer = True, model.dtype = 'fp32')") in other.stderr, other.stderr[-3000:]
    assert sorted(p.relative_to(stopped) for p in stopped.rglob("*")) == before
    proc = run_train(config, "trainer.total_training_steps=3", "trainer.save_freq=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "global_step_2 (step 2, verified)" in proc.stdout + proc.stderr
    resumed = read_metrics(stopped / "run")
    assert sorted(resumed) == [1, 2, 3]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
        assert resumed[3][key] == pytest.approx(expected[3][key], rel=1e-5, abs=1e-7), key


def test_grpo_learns_arithmetic_from_scratch(tmp_path: Path, task_dir: Path) -> None:
    """The quickstart recipe on a fixed budget: validation reward must rise well above its start."""
    data = {"train_files": [str(task_dir / "train.parquet")], "val_files": [str(task_dir / "val.parquet")],
            "tokenizer": str(task_dir / "tokenizer")}
    config = tmp_path / "learn.yaml"
    config.write_text(yaml.safe_dump({
        "extends": str(ROOT / "configs" / "quickstart_cpu.yaml"),
        "data": data,
        "trainer": {"total_training_steps": 60, "test_freq": 60, "save_freq": -1, "val_before_train": True,
                    "progress_bar": False, "default_local_dir": str(tmp_path / "run")},
        "tracking": {"backends": ["jsonl"]},
    }))
    assert run_train(config, timeout=900).returncode == 0
    metrics = read_metrics(tmp_path / "run")
    before, after = metrics[0]["val/reward_mean"], metrics[60]["val/reward_mean"]
    assert after >= before + 0.25, f"validation reward {before:.3f} -> {after:.3f} after 60 GRPO steps"


# ReMax (its greedy baseline is one more generation per step) runs in `make test`; the others only
# change the advantage or the loss, which the unit tier checks against hand-worked references, and
# run end to end with `make test-slow`.
@pytest.mark.parametrize(
    "name, overrides",
    [
        pytest.param("rloo", ["algorithm.adv_estimator=rloo"], marks=pytest.mark.slow),
        pytest.param("reinforce_plus_plus", ["algorithm.adv_estimator=reinforce_plus_plus", "actor.use_kl_loss=true"],
                     marks=pytest.mark.slow),
        ("remax", ["algorithm.adv_estimator=remax", "rollout.n=2"]),
        pytest.param("gspo", ["actor.policy_loss.loss_mode=gspo", "actor.loss_agg_mode=seq-mean-token-mean"],
                     marks=pytest.mark.slow),
        pytest.param("drgrpo", ["algorithm.norm_adv_by_std_in_grpo=false", "actor.loss_agg_mode=seq-mean-token-sum-norm"],
                     marks=pytest.mark.slow),
    ],
)
def test_algorithm_relatives_run_one_step(tmp_path: Path, task_dir: Path, name: str, overrides: list[str]) -> None:
    config = write_config(tmp_path, task_dir)
    proc = run_train(config, "trainer.total_training_steps=1", *overrides)
    assert proc.returncode == 0, name
    step = read_metrics(tmp_path / "run")[1]
    assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["actor/grad_norm"]), name
    assert math.isfinite(step["critic/advantages/mean"]), name


TINY_MOE = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}


def test_grpo_with_a_mixture_of_experts_model(tmp_path: Path, task_dir: Path) -> None:
    """Qwen3-MoE through the whole loop: Megatron MoE layers (alltoall dispatcher) in actor and
    reference, expert weights synced into the HF rollout engine's fused experts."""
    config = write_config(tmp_path, task_dir, model={"hf_config": TINY_MOE},
                          actor={"megatron": {"tensor_model_parallel_size": 1}, "use_kl_loss": True})
    proc = run_train(config)
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/score/mean"):
        assert math.isfinite(metrics[2][key]), key
    # The reference model starts equal to the actor: the KL after one update is small but not zero.
    assert 0 <= metrics[2]["actor/kl_loss"] < 1.0


def test_grpo_with_whole_experts_on_tensor_parallel_ranks(tmp_path: Path, task_dir: Path) -> None:
    """Qwen3-MoE trained at TP=2 (sequence parallel) with expert tensor parallelism 1 and EP=2 on the
    two workers: attention split over the TP ranks, each rank holding two whole experts; the weight
    sync into the HF rollout engine moves exactly the minimum."""
    megatron = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                "expert_tensor_parallel_size": 1}
    config = write_config(tmp_path, task_dir, model={"hf_config": TINY_MOE}, actor={"megatron": megatron})
    proc = run_train(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
        assert math.isfinite(metrics[2][key]), key
    for step in (1, 2):
        assert metrics[step]["sync/bytes_received"] == metrics[step]["sync/bytes_minimum"] > 0
        assert metrics[step]["sync/bytes_excess_max"] == 0
