"""Keys refused where this config never reads them (megarl/config/inert_keys.py): the multi-turn
settings without multi-turn rollouts, validation sampling under argmax validation, a constant
schedule's length, the probe's batch without the probe, a log-prob gap nothing compares, mlflow's
store without mlflow. Each value is refused naming the key and accepted where it is read; the
defaults are never refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import load_config
from test_config import VALID, errors_of, write

pytestmark = pytest.mark.unit


@pytest.fixture
def valid_file(tmp_path: Path) -> Path:
    return write(tmp_path, "exp.yaml", VALID)


def test_defaults_are_never_refused(valid_file: Path) -> None:
    cfg = load_config(valid_file)
    assert not cfg.rollout.multi_turn.enable and not cfg.rollout.val_kwargs.do_sample
    assert cfg.rollout.probe_freq == 0 and cfg.actor.optim.lr_scheduler == "constant"
    assert "mlflow" in cfg.tracking.backends
    # Off by default, each setting's default stays accepted beside a change of what reads it.
    load_config(valid_file, ["tracking.backends=[console]", "rollout.top_p=0.5", "critic.enable=true"])


def test_multi_turn_settings_need_multi_turn_rollouts(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.multi_turn.max_turns=3", "rollout.multi_turn.tool_timeout_s=5",
                    "rollout.multi_turn.wait_for_tools=false")
    assert ("rollout.multi_turn.max_turns = 3, rollout.multi_turn.tool_timeout_s = 5.0, "
            "rollout.multi_turn.wait_for_tools = False with rollout.multi_turn.enable = false: only the multi-turn "
            "agent loop reads them") in msg
    msg = errors_of(valid_file, "rollout.multi_turn.max_tool_response_chars=64",
                    "rollout.multi_turn.tool_response_truncate_side=right")
    assert "rollout.multi_turn.max_tool_response_chars = 64, rollout.multi_turn.tool_response_truncate_side = 'right'" in msg
    on = ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"]
    cfg = load_config(valid_file, [*on, "rollout.multi_turn.max_turns=3", "rollout.multi_turn.tool_timeout_s=5",
                                   "rollout.multi_turn.wait_for_tools=false"])
    assert cfg.rollout.multi_turn.max_turns == 3
    # Tools named with multi-turn off are refused like the other settings; an empty list is the default.
    assert "rollout.multi_turn.tools = ['calculator'] with rollout.multi_turn.enable = false" in errors_of(
        valid_file, "rollout.multi_turn.tools=[calculator]")
    assert not load_config(valid_file, ["rollout.multi_turn.tools=[]"]).rollout.multi_turn.enable


def test_validation_sampling_keys_need_sampled_validation(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.val_kwargs.temperature=0.6", "rollout.val_kwargs.top_p=0.9",
                    "rollout.val_kwargs.top_k=20")
    assert ("rollout.val_kwargs.temperature = 0.6, rollout.val_kwargs.top_p = 0.9, rollout.val_kwargs.top_k = 20 "
            "with rollout.val_kwargs.do_sample = false: validation decodes by argmax") in msg
    cfg = load_config(valid_file, ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=0.6",
                                   "rollout.val_kwargs.top_p=0.9", "rollout.val_kwargs.top_k=20",
                                   "data.val_files=[val.parquet]"])
    assert (cfg.rollout.val_kwargs.temperature, cfg.rollout.val_kwargs.top_k) == (0.6, 20)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_constant_schedule_reads_no_length(valid_file: Path, role: str) -> None:
    on = ["critic.enable=true"] if role == "critic" else []
    key = f"{role}.optim"
    msg = errors_of(valid_file, *on, f"{key}.total_training_steps=50")
    assert (f"{key}.total_training_steps = 50 with {key}.lr_scheduler = 'constant' and no warmup "
            f"({key}.lr_warmup_steps_ratio = 0): the schedule's length is read only by a decaying schedule") in msg
    msg = errors_of(valid_file, *on, f"{key}.total_training_steps=50", f"{key}.lr_warmup_steps=5")
    assert (f"{key}.total_training_steps = 50 with {key}.lr_scheduler = 'constant' and {key}.lr_warmup_steps = 5 "
            "(the warmup counted in steps)") in msg
    for reads in ([f"{key}.lr_scheduler=cosine"], [f"{key}.lr_scheduler=linear", f"{key}.lr_warmup_steps=5"],
                  [f"{key}.lr_warmup_steps_ratio=0.1"]):
        assert load_config(valid_file, [*on, f"{key}.total_training_steps=50", *reads])[role].optim.total_training_steps == 50


def test_probe_prompts_need_the_probe(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.probe_prompts=3")
    assert "rollout.probe_prompts = 3 with rollout.probe_freq = 0: only the weight-sync probe reads it" in msg
    assert load_config(valid_file, ["rollout.probe_freq=2", "rollout.probe_prompts=3"]).rollout.probe_prompts == 3


def test_a_logprob_gap_nothing_compares(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.top_p=0.5", "rollout.max_logprob_gap=0.5")
    assert ("rollout.max_logprob_gap = 0.5 with rollout.probe_freq = 0: the per-step check is skipped under this "
            "sampling (rollout.top_p = 0.5 with rollout.logprobs_mode = 'processed'") in msg
    msg = errors_of(valid_file, "rollout.logprobs_mode=raw", "rollout.temperature=0.7", "rollout.max_logprob_gap=0.5")
    assert "rollout.max_logprob_gap = 0.5 with rollout.probe_freq = 0" in msg
    assert "(rollout.logprobs_mode = 'raw' gives log_softmax(logits), the trainer log_softmax(logits / 0.7)" in msg
    assert "use logprobs_mode processed (or temperature 1), or remove it" in msg
    # Read: by the per-step check (no filter; raw at temperature 1), by the probe, or null (no warning).
    for reads in (["rollout.top_k=0"], ["rollout.logprobs_mode=raw", "rollout.top_p=0.5"],
                  ["rollout.top_p=0.5", "rollout.probe_freq=1"]):
        assert load_config(valid_file, [*reads, "rollout.max_logprob_gap=0.5"]).rollout.max_logprob_gap == 0.5
    assert load_config(valid_file, ["rollout.top_p=0.5", "rollout.max_logprob_gap=null"]).rollout.max_logprob_gap is None
    # Without the rollout's log-probs the per-step check has nothing to compare: read by the probe only.
    msg = errors_of(valid_file, "rollout.calculate_log_probs=false", "rollout.max_logprob_gap=1e-5")
    assert ("rollout.max_logprob_gap = 1e-05 with rollout.calculate_log_probs = false and rollout.probe_freq = 0: "
            "the per-step check compares the rollout's log-probs, which are not kept") in msg
    cfg = load_config(valid_file, ["rollout.calculate_log_probs=false", "rollout.max_logprob_gap=1e-5",
                                   "rollout.probe_freq=1"])
    assert cfg.rollout.max_logprob_gap == 1e-5


def test_validation_keys_without_a_validation_set(valid_file: Path) -> None:
    # megarl.trainer.loop validates only when data.val_files is set; every key below is read only there.
    msg = errors_of(valid_file, "data.val_files=[]", "data.val_batch_size=16", "trainer.test_freq=5",
                    "trainer.validation_data_dir=dumps", "rollout.val_kwargs.n=2", "rollout.val_kwargs.do_sample=true")
    assert ("data.val_batch_size = 16, trainer.test_freq = 5, trainer.validation_data_dir = 'dumps', "
            "rollout.val_kwargs.n = 2, rollout.val_kwargs.do_sample = True with no data.val_files: only validation "
            "reads them") in msg
    # With a validation set they are read; without one, turning validation off is not refused.
    cfg = load_config(valid_file, ["data.val_files=[val.parquet]", "data.val_batch_size=16", "trainer.test_freq=5"])
    assert (cfg.data.val_batch_size, cfg.trainer.test_freq) == (16, 5)
    assert not load_config(valid_file, ["data.val_files=[]", "trainer.val_before_train=false"]).trainer.val_before_train
