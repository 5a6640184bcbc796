"""Experiment config: loading, `extends`, overrides, and one test per validation rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from omegaconf import OmegaConf

from megarl.cli import main as cli_main
from megarl.config import all_keys, load_config, suggest_key
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError
from megarl.layout import ParallelLayout
from megarl.trainer.run_spec import parallel_layout

pytestmark = pytest.mark.unit

TINY_MODEL = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "vocab_size": 64,
    "max_position_embeddings": 128,
}

VALID = {
    "data": {
        "train_files": ["train.parquet"],
        "train_batch_size": 8,
        "max_prompt_length": 32,
        "max_response_length": 16,
    },
    "model": {"hf_config": TINY_MODEL},
    "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "megatron": {"tensor_model_parallel_size": 2}},
    "rollout": {"n": 4},
    "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 2}},
}


def write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def valid_file(tmp_path: Path) -> Path:
    return write(tmp_path, "exp.yaml", VALID)


def errors_of(path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def test_valid_config_loads_with_types(valid_file: Path) -> None:
    cfg = load_config(valid_file)
    assert cfg.actor.megatron.tensor_model_parallel_size == 2
    assert cfg.actor.optim.lr == pytest.approx(1e-6)  # schema default survives
    assert isinstance(cfg.rollout.n, int)


def test_overrides_apply_and_are_typed(valid_file: Path) -> None:
    cfg = load_config(valid_file, ["actor.optim.lr=3e-5", "rollout.n=8", "data.train_files=[a.parquet,b.parquet]"])
    assert cfg.actor.optim.lr == pytest.approx(3e-5)
    assert cfg.rollout.n == 8
    assert list(cfg.data.train_files) == ["a.parquet", "b.parquet"]


def test_extends_merges_base_then_child(tmp_path: Path) -> None:
    write(tmp_path, "base.yaml", VALID)
    (tmp_path / "sub").mkdir()
    child = write(tmp_path / "sub", "child.yaml", {"extends": "../base.yaml", "rollout": {"n": 8}, "actor": {"optim": {"lr": 2e-6}}})
    cfg = load_config(child)
    assert cfg.rollout.n == 8
    assert cfg.actor.optim.lr == pytest.approx(2e-6)
    assert cfg.actor.megatron.tensor_model_parallel_size == 2  # from the base


def test_extends_cycle_is_reported(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", {"extends": "b.yaml"})
    b = write(tmp_path, "b.yaml", {"extends": "a.yaml"})
    assert "cycle" in errors_of(b)


def test_interpolation_resolves(valid_file: Path) -> None:
    cfg = load_config(valid_file, ["trainer.project_name=p", "trainer.experiment_name=e"])
    assert cfg.trainer.default_local_dir == "runs/p/e"


# --- one test per rule -------------------------------------------------------------------------


def test_unknown_key_names_file_and_suggests(tmp_path: Path) -> None:
    bad = dict(VALID, rollout={"n": 4, "temprature": 0.7})
    path = write(tmp_path, "bad.yaml", bad)
    msg = errors_of(path)
    assert str(path) in msg
    assert "unknown key 'rollout.temprature'" in msg
    assert "did you mean 'rollout.temperature'" in msg


def test_unknown_key_in_override_suggests_nested_key(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.lr=1e-5")
    assert "command-line override 'actor.lr=1e-5'" in msg
    assert "did you mean 'actor.optim.lr'" in msg


def test_unknown_key_without_a_close_match_points_at_the_key_list(valid_file: Path) -> None:
    msg = errors_of(valid_file, "zzqx.wvut=1")
    assert "unknown key 'zzqx'" in msg
    assert "run `megarl config keys` to list the valid keys" in msg


def test_unknown_section(valid_file: Path) -> None:
    msg = errors_of(valid_file, "optimizer.lr=1")
    assert "unknown key 'optimizer'" in msg


def test_wrong_type_names_key(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.optim.lr=fast")
    assert "actor.optim.lr" in msg and "Float" in msg


def test_section_given_a_scalar(tmp_path: Path) -> None:
    path = write(tmp_path, "bad.yaml", dict(VALID, actor=3))
    assert "'actor' is a section" in errors_of(path)


def test_mini_batch_must_divide_train_batch(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.ppo_mini_batch_size=3")
    assert "actor.ppo_mini_batch_size = 3 must divide data.train_batch_size = 8" in msg
    assert "valid: 1, 2, 4, 8" in msg


def test_mini_batch_sequences_divisible_by_dp(valid_file: Path) -> None:
    # TP=1 on 2 devices -> DP=2; 1 prompt x 1 response = 1 sequence cannot split over 2 ranks.
    msg = errors_of(valid_file, "actor.megatron.tensor_model_parallel_size=1", "actor.ppo_mini_batch_size=1",
                    "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus")
    assert "must be divisible by the data-parallel size 2" in msg


def test_micro_batch_must_divide_per_rank_share(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.ppo_micro_batch_size_per_gpu=3")
    assert "actor.ppo_micro_batch_size_per_gpu = 3 must divide the 16 sequences" in msg
    assert "valid: 1, 2, 4, 8, 16" in msg


def test_critic_batches_checked_when_gae(valid_file: Path) -> None:
    msg = errors_of(valid_file, "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=5")
    assert "critic.ppo_mini_batch_size = 5 must divide data.train_batch_size = 8" in msg


def test_tp_must_divide_heads(valid_file: Path) -> None:
    msg = errors_of(valid_file, "model.hf_config.num_attention_heads=6", "model.hf_config.num_key_value_heads=6",
                    "resources.actor_pool.devices_per_node=4", "actor.megatron.tensor_model_parallel_size=4")
    assert "must divide the model's num_attention_heads = 6; valid: 1, 2, 3, 6" in msg


def test_tp_must_divide_query_groups(valid_file: Path) -> None:
    msg = errors_of(valid_file, "resources.actor_pool.devices_per_node=4", "actor.megatron.tensor_model_parallel_size=4")
    assert "query groups (num_key_value_heads = 2); valid: 1, 2" in msg


def test_tp_pp_cp_must_divide_pool(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.megatron.pipeline_model_parallel_size=3", "actor.megatron.tensor_model_parallel_size=1")
    assert "TP x PP x CP = 1 x 3 x 1 = 3 does not divide the 2 devices of resources.actor_pool" in msg


def test_explicit_dp_must_complete_the_product(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.megatron.data_parallel_size=2")
    assert "TP x PP x CP x DP must equal the 2 devices of resources.actor_pool, so DP must be 1" in msg


def test_pp_must_divide_layers(valid_file: Path) -> None:
    msg = errors_of(valid_file, "model.hf_config.num_hidden_layers=3", "actor.megatron.tensor_model_parallel_size=1",
                    "actor.megatron.pipeline_model_parallel_size=2")
    assert "must divide num_hidden_layers = 3" in msg


def test_ep_needs_experts(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.megatron.tensor_model_parallel_size=1", "actor.megatron.expert_model_parallel_size=2")
    assert "the model has no experts" in msg


def test_moe_limits_of_the_trainer_are_refused_before_workers(tmp_path: Path) -> None:
    moe = dict(VALID, model={"hf_config": {**TINY_MODEL, "model_type": "qwen3_moe", "num_experts": 4,
                                           "num_experts_per_tok": 2, "moe_intermediate_size": 32}})
    path = write(tmp_path, "moe.yaml", moe)
    msg = errors_of(path, "rollout.tensor_model_parallel_size=2")  # actor TP=2 in VALID
    assert "actor.megatron.tensor_model_parallel_size = 2: training a mixture-of-experts model with TP > 1 needs " \
        "actor.megatron.sequence_parallel: true" in msg
    assert "rollout.tensor_model_parallel_size" not in msg  # experts are resharded into vLLM's fused parameters
    cfg = load_config(path, ["actor.megatron.sequence_parallel=true"])  # MoE at TP=2 trains with SP
    assert cfg.actor.megatron.sequence_parallel
    cfg = load_config(path, ["actor.megatron.tensor_model_parallel_size=1"])  # TP = EP = 1: accepted
    assert cfg.actor.megatron.tensor_model_parallel_size == 1
    # An expert-parallel actor is accepted (the weight sync reshards its experts) ...
    cfg = load_config(path, ["actor.megatron.tensor_model_parallel_size=1", "actor.megatron.expert_model_parallel_size=2"])
    assert cfg.actor.megatron.expert_model_parallel_size == 2
    # ... also into vLLM at rollout TP > 1 (experts in vLLM's fused expert parameters).
    cfg = load_config(path, ["actor.megatron.tensor_model_parallel_size=1", "actor.megatron.expert_model_parallel_size=2",
                             "rollout.tensor_model_parallel_size=2"])
    assert cfg.rollout.tensor_model_parallel_size == 2
    # Expert tensor parallelism other than TP: TP=2 with whole experts, EP over all 2 ranks.
    cfg = load_config(path, ["actor.megatron.sequence_parallel=true", "actor.megatron.expert_tensor_parallel_size=1",
                             "actor.megatron.expert_model_parallel_size=2"])
    assert cfg.actor.megatron.expert_tensor_parallel_size == 1
    assert parallel_layout(cfg.actor.megatron).resolved(2) == ParallelLayout(tp=2, dp=1, ep=2, etp=1)
    msg = errors_of(path, "actor.megatron.sequence_parallel=true", "actor.megatron.expert_tensor_parallel_size=1",
                    "actor.megatron.expert_model_parallel_size=4")
    assert "expert_tensor_parallel_size x expert_model_parallel_size = 1 x 4 must divide the TP x CP x DP = 2 " \
        "ranks of a pipeline stage" in msg
    msg = errors_of(path, "actor.megatron.tensor_model_parallel_size=1", "actor.megatron.expert_tensor_parallel_size=3")
    assert "expert_tensor_parallel_size = 3: must divide the model's moe_intermediate_size = 32" in msg
    assert "expert_tensor_parallel_size x expert_model_parallel_size = 3 x 1 must divide" in msg
    msg = errors_of(path, "actor.megatron.sequence_parallel=true", "actor.megatron.expert_tensor_parallel_size=0")
    assert "expert_tensor_parallel_size = 0: must be >= 1 (or null: the tensor parallel size)" in msg


def test_expert_tensor_parallelism_needs_experts(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.megatron.expert_tensor_parallel_size=1")  # VALID: dense, TP=2
    assert "expert_tensor_parallel_size = 1: the model has no experts; leave it null" in msg


def test_rollout_tp_must_divide_world(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.tensor_model_parallel_size=3")
    assert "rollout.tensor_model_parallel_size = 3: must divide the 2 devices" in msg


def test_rollout_tp_must_split_every_tensor_the_weight_sync_splits(tmp_path: Path) -> None:
    """What the weight sync's plan needs of the rollout TP (megarl.hybrid.slices) is checked before
    any worker starts; before, a run stopped at its first weight sync. Six ranks, 24 heads (6
    divides them) but 8 key/value heads, an MLP of 8192 and a vocabulary of 100 (padded to 128)."""
    model = {**TINY_MODEL, "num_attention_heads": 24, "num_key_value_heads": 8, "hidden_size": 96,
             "intermediate_size": 8192, "vocab_size": 100}
    path = write(tmp_path, "rtp.yaml", dict(VALID, model={"hf_config": model},
                                            resources={"actor_pool": {"nnodes": 1, "devices_per_node": 6}}))
    msg = errors_of(path, "rollout.tensor_model_parallel_size=6", "actor.megatron.tensor_model_parallel_size=1",
                    "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "actor.ppo_micro_batch_size_per_gpu=1")
    assert "rollout.tensor_model_parallel_size = 6: must divide num_key_value_heads = 8 (1, 2, 4, 8) or be a multiple" in msg
    assert "rollout.tensor_model_parallel_size = 6: must divide intermediate_size = 8192" in msg
    assert "rollout.tensor_model_parallel_size = 6: must divide the vocabulary padded to a multiple of 64 (100 -> 128)" in msg
    # Fewer key/value heads than ranks (each replicated) and whole shards pass: 24 heads, 2 KV heads.
    ok = {**model, "num_key_value_heads": 2, "intermediate_size": 8256, "vocab_size": 192}
    path = write(tmp_path, "rtp_ok.yaml", dict(VALID, model={"hf_config": ok},
                                               resources={"actor_pool": {"nnodes": 1, "devices_per_node": 6}}))
    cfg = load_config(path, ["rollout.tensor_model_parallel_size=6", "actor.megatron.tensor_model_parallel_size=1",
                             "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "actor.ppo_micro_batch_size_per_gpu=1"])
    assert cfg.rollout.tensor_model_parallel_size == 6


def test_grpo_needs_n_at_least_2(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.n=1")
    assert "rollout.n = 1" in msg and "needs rollout.n >= 2" in msg


def test_dapo_filter_needs_groups(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus",
                    "algorithm.filter_groups.enable=true", "actor.megatron.tensor_model_parallel_size=2",
                    "actor.ppo_micro_batch_size_per_gpu=1")
    assert "filter_groups (DAPO dynamic sampling) needs rollout.n >= 2" in msg


def test_unknown_estimator_lists_valid(valid_file: Path) -> None:
    msg = errors_of(valid_file, "algorithm.adv_estimator=ppo2")
    assert "algorithm.adv_estimator = 'ppo2': must be one of" in msg and "'grpo'" in msg


def test_enum_values(valid_file: Path) -> None:
    msg = errors_of(valid_file, "actor.loss_agg_mode=mean", "rollout.engine=sglang", "resources.cpu_grad_reduce=shm")
    assert "actor.loss_agg_mode = 'mean': must be one of" in msg
    assert "rollout.engine = 'sglang': must be one of ['auto', 'hf', 'vllm']" in msg
    assert "resources.cpu_grad_reduce = 'shm': must be one of ['gloo', 'shared_memory']" in msg


def test_ranges(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.top_p=0", "actor.optim.lr=-1", "actor.clip_ratio_c=0.5", "algorithm.gamma=1.5")
    assert "rollout.top_p = 0.0: must be in (0.0, 1.0]" in msg
    assert "actor.optim.lr = -1.0: must be >= 0" in msg
    assert "actor.clip_ratio_c = 0.5" in msg
    assert "algorithm.gamma = 1.5: must be in [0.0, 1.0]" in msg


def test_lengths_fit_the_model(valid_file: Path) -> None:
    msg = errors_of(valid_file, "data.max_prompt_length=100", "data.max_response_length=100")
    assert "exceeds the model's max_position_embeddings = 128" in msg


def test_gae_needs_critic(valid_file: Path) -> None:
    assert "needs a critic" in errors_of(valid_file, "algorithm.adv_estimator=gae", "critic.enable=false")


def test_resume_path_needs_path(valid_file: Path) -> None:
    assert "needs trainer.resume_from_path" in errors_of(valid_file, "trainer.resume_mode=resume_path")


def test_resume_fallback_only_with_auto_resume(valid_file: Path) -> None:
    msg = errors_of(valid_file, "trainer.resume_fallback=true", "trainer.resume_mode=resume_path",
                    "trainer.resume_from_path=/ckpt/global_step_2")
    assert "trainer.resume_fallback = true with trainer.resume_mode = 'resume_path'" in msg
    load_config(valid_file, ["trainer.resume_fallback=true"])  # resume_mode auto: valid


def test_resume_from_path_only_with_resume_path_mode(valid_file: Path) -> None:
    # 'auto' would resume the run's own newest checkpoint and 'disable' start fresh, the path unread.
    for mode in ("auto", "disable"):
        msg = errors_of(valid_file, f"trainer.resume_mode={mode}", "trainer.resume_from_path=/ckpt/global_step_2")
        assert (f"trainer.resume_from_path = '/ckpt/global_step_2' with trainer.resume_mode = '{mode}': the path is "
                "read with resume_mode 'resume_path' only") in msg
    load_config(valid_file, ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/global_step_2"])


def test_a_kl_term_needs_the_reference_policy(valid_file: Path) -> None:
    msg = errors_of(valid_file, "ref.enable=false", "actor.use_kl_loss=true")
    assert "ref.enable = false with actor.use_kl_loss = true: the KL term needs the reference policy's" in msg
    msg = errors_of(valid_file, "ref.enable=false", "algorithm.use_kl_in_reward=true", "actor.use_kl_loss=true")
    assert "ref.enable = false with actor.use_kl_loss = true and algorithm.use_kl_in_reward = true" in msg
    load_config(valid_file, ["actor.use_kl_loss=true"])  # ref.enable null: on for the KL term
    load_config(valid_file, ["ref.enable=false"])  # no KL term: valid


def test_sampling_keys_are_checked_before_workers(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.top_k=-5", "rollout.val_kwargs.top_k=-3")
    assert "rollout.top_k = -5: must be -1 or 0 (off) or k >= 1" in msg
    assert "rollout.val_kwargs.top_k = -3: must be -1 or 0 (off)" in msg
    msg = errors_of(valid_file, "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=0")
    assert "rollout.val_kwargs.temperature = 0.0 with do_sample: true: sampling needs a temperature > 0" in msg
    msg = errors_of(valid_file, "rollout.val_kwargs.n=4")
    assert "rollout.val_kwargs.n = 4 with do_sample: false: argmax decoding gives n identical responses" in msg
    msg = errors_of(valid_file, "rollout.engine=hf", "rollout.tensor_model_parallel_size=2")
    assert "rollout.tensor_model_parallel_size = 2 with rollout.engine = 'hf'" in msg
    load_config(valid_file, ["rollout.top_k=0", "rollout.val_kwargs.n=4", "rollout.val_kwargs.do_sample=true",
                             "data.val_files=[val.parquet]"])


def test_reward_kl_keys_need_the_kl_in_reward(valid_file: Path) -> None:
    # kl_penalty and kl_ctrl.* shape only the KL penalty in the reward; without it they would do nothing.
    msg = errors_of(valid_file, "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_penalty=low_var_kl")
    assert ("algorithm.kl_penalty = 'low_var_kl', algorithm.kl_ctrl.kl_coef = 0.05 without "
            "algorithm.use_kl_in_reward: these shape the KL penalty in the reward only") in msg
    msg = errors_of(valid_file, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.horizon=500")
    assert "algorithm.kl_ctrl.horizon = 500 with algorithm.kl_ctrl.type = 'fixed': only the adaptive" in msg
    load_config(valid_file, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                             "algorithm.kl_ctrl.horizon=500", "algorithm.kl_penalty=low_var_kl"])
    load_config(valid_file, ["algorithm.kl_ctrl.kl_coef=0.001"])  # the default value: not a setting


@pytest.mark.parametrize("override", ["data.train_files=[a.parquet", "trainer.experiment_name=@x"])
def test_an_override_that_is_not_yaml_is_a_config_error(override: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override], validate=False)
    assert f"command-line override '{override}': the value is not valid YAML" in str(err.value)


def test_keys_read_only_in_another_mode_are_refused_by_name(valid_file: Path) -> None:
    msg = errors_of(valid_file, "algorithm.pass_k=3")
    assert "algorithm.pass_k = 3: read by algorithm.adv_estimator 'grpo_passk' only, not 'grpo'" in msg
    load_config(valid_file, ["algorithm.pass_k=3", "algorithm.adv_estimator=grpo_passk", "rollout.n=4"])
    msg = errors_of(valid_file, "trainer.partial_rollout_interrupt_after=2")
    assert "trainer.partial_rollout_interrupt_after = 2 with trainer.partial_rollout = 'off'" in msg
    for role in ("critic", "ref", "reward_model"):
        msg = errors_of(valid_file, f"+resources.{role}_pool={{nnodes: 1, devices_per_node: 1}}")
        assert f"resources.{role}_pool is set but the run has no {role}" in msg


def test_critic_warmup_needs_a_critic(valid_file: Path) -> None:
    assert "steps that train only the critic need one" in errors_of(valid_file, "trainer.critic_warmup=2")
    load_config(valid_file, ["trainer.critic_warmup=2", "critic.enable=true"])  # valid


def test_model_path_config_json_is_read(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(dict(TINY_MODEL, num_key_value_heads=1)))
    data = dict(VALID, model={"path": str(model_dir)})
    msg = errors_of(write(tmp_path, "exp.yaml", data))
    assert "num_key_value_heads = 1" in msg


def test_all_problems_reported_together(valid_file: Path) -> None:
    msg = errors_of(valid_file, "rollout.n=1", "actor.ppo_mini_batch_size=3")
    assert "rollout.n = 1" in msg and "ppo_mini_batch_size = 3" in msg


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    assert "config file not found" in errors_of(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed")
    assert "not valid YAML" in errors_of(bad)


def test_suggestions() -> None:
    assert suggest_key("actor.megatron.tp") == "actor.megatron.tensor_model_parallel_size"
    assert suggest_key("algorithm.adv_estimater") == "algorithm.adv_estimator"
    assert "actor.optim.lr" in all_keys()


def test_cli_validate_and_show(valid_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --schema-only: the config alone (its train file and tokenizer do not exist here; the file checks
    # are tested in test_run_files.py).
    assert cli_main(["config", "validate", "--schema-only", str(valid_file)]) == 0
    assert "valid (files not checked)" in capsys.readouterr().out
    assert cli_main(["config", "validate", str(valid_file), "rollout.n=1"]) == 1
    assert "rollout.n = 1" in capsys.readouterr().err
    assert cli_main(["config", "show", str(valid_file), "rollout.n=6"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["rollout"]["n"] == 6


def _stand_in_reward_model(path: Path, hf_config: dict) -> Path:
    """A 1-label Qwen2 sequence-classifier of the recipe's shape with a tokenizer of its own: the
    checkpoint a make target fits before the recipe runs (`make demo-rm`) does not exist in a checkout."""
    config = transformers.Qwen2Config(**{**hf_config, "vocab_size": 64}, num_labels=1, pad_token_id=0)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    build_char_tokenizer("0123456789+=", path)
    return path


def test_shipped_configs_validate(tmp_path: Path) -> None:
    """Every shipped recipe passes every rule (layouts against the architecture it names)."""
    root = Path(__file__).resolve().parents[3] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert len(files) >= 4, f"configs/ should hold the quickstart and the real-scale recipes, found {files}"
    for path in files:
        raw = load_config(path, validate=False)
        overrides = []
        if raw.reward_model.enable and not Path(raw.reward_model.model_path).exists():
            made = str(_stand_in_reward_model(tmp_path / path.stem, OmegaConf.to_container(raw.model.hf_config)))
            overrides.append(f"reward_model.model_path={made}")
            if raw.critic.model_path == raw.reward_model.model_path:
                overrides.append(f"critic.model_path={made}")
        cfg = load_config(path, overrides)
        assert cfg.data.train_files, path


def test_pass_k_within_group(valid_file: Path) -> None:
    msg = errors_of(valid_file, "algorithm.adv_estimator=grpo_passk", "algorithm.pass_k=9")
    assert "algorithm.pass_k = 9: must be in [2, rollout.n = 4]" in msg
    load_config(valid_file, ["algorithm.adv_estimator=grpo_passk"])  # null: the group size


def test_kl_types_accept_straight_through(valid_file: Path) -> None:
    load_config(valid_file, ["actor.kl_loss_type=low_var_kl+", "actor.use_kl_loss=true"])
    assert "actor.kl_loss_type = 'full'" in errors_of(valid_file, "actor.kl_loss_type=full")


def test_colocated_ref_and_critic_follow_the_actor_layout(valid_file: Path) -> None:
    cfg = load_config(valid_file, ["actor.use_kl_loss=true", "algorithm.adv_estimator=gae"])
    assert cfg.ref.megatron is None and cfg.critic.megatron is None  # null: the actor's layout
    msg = errors_of(valid_file, "actor.use_kl_loss=true", "ref.megatron={tensor_model_parallel_size: 1}")
    assert "ref.megatron differs from actor.megatron" in msg


def test_fp16_training_is_refused_with_what_to_use(valid_file: Path) -> None:
    msg = errors_of(valid_file, "model.dtype=fp16")
    assert "model.dtype = 'fp16': training in fp16 needs loss scaling" in msg and "use bf16" in msg
    assert load_config(valid_file, ["model.dtype=bf16", "rollout.dtype=fp16"]).rollout.dtype == "fp16"


def test_model_spec_must_name_a_family(valid_file: Path) -> None:
    msg = errors_of(valid_file, "model.spec=qwen9")
    assert "model.spec = 'qwen9': no such family in model_specs/" in msg and "'qwen2'" in msg
    assert load_config(valid_file, ["model.spec=llama"]).model.spec == "llama"


def test_removed_verl_keys_say_what_to_use(valid_file: Path, tmp_path: Path) -> None:
    msg = errors_of(valid_file, "data.dataloader_num_workers=4")
    assert "'data.dataloader_num_workers' is not a megarl key: megarl reads prompts from parquet in the driver" in msg
    bad = write(tmp_path, "verl.yaml", {**VALID, "actor": {**VALID["actor"], "use_remove_padding": True}})
    assert "'actor.use_remove_padding' is not a megarl key: use model.use_remove_padding" in errors_of(bad)
    assert "'trainer.log_freq' is not a megarl key: every step's metrics go to" in errors_of(valid_file, "trainer.log_freq=5")


def test_megatron_layout_options_megarl_lacks_are_refused_by_name(valid_file: Path, tmp_path: Path) -> None:
    critic = {"megatron": {"virtual_pipeline_model_parallel_size": 2}}
    bad = write(tmp_path, "vpp.yaml", {**VALID, "critic": {**VALID.get("critic", {}), **critic}})
    msg = errors_of(bad)
    assert "'critic.megatron.virtual_pipeline_model_parallel_size' is not supported: megarl has no virtual" in msg
    # Outside a megatron section the generic error stays.
    assert "unknown key 'actor.virtual_pipeline_model_parallel_size'" in errors_of(
        valid_file, "actor.virtual_pipeline_model_parallel_size=2")


def test_recompute_granularity_and_dapo_generation_batch(valid_file: Path) -> None:
    assert "model.recompute_granularity = 'layers'" in errors_of(valid_file, "model.recompute_granularity=layers")
    assert "data.gen_batch_size is only used by DAPO dynamic sampling" in errors_of(valid_file, "data.gen_batch_size=16")
    dapo = ["algorithm.filter_groups.enable=true"]
    assert "data.gen_batch_size = 4: must be >= data.train_batch_size = 8" in errors_of(valid_file, *dapo, "data.gen_batch_size=4")
    assert load_config(valid_file, [*dapo, "data.gen_batch_size=24"]).data.gen_batch_size == 24
    msg = errors_of(valid_file, *dapo, "algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true")
    assert "the KL penalty is computed after dynamic sampling" in msg


def test_override_config_cannot_reshape_a_checkpoint(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_MODEL))
    path = write(tmp_path, "exp.yaml", dict(VALID, model={"path": str(model_dir)}))
    msg = errors_of(path, "+model.override_config.hidden_size=128", "+model.override_config.rope_theta=500000.0")
    assert "model.override_config sets ['hidden_size'] over the checkpoint in model.path" in msg
    cfg = load_config(path, ["+model.override_config.rope_theta=500000.0"])
    assert cfg.model.override_config.rope_theta == 500000.0


def test_val_only_needs_validation_files(valid_file: Path) -> None:
    assert "trainer.val_only = true needs data.val_files" in errors_of(valid_file, "trainer.val_only=true")
    assert load_config(valid_file, ["trainer.val_only=true", "data.val_files=[val.parquet]"]).trainer.val_only


def test_sync_verify_freq_is_never_or_every_kth(valid_file: Path) -> None:
    assert ("rollout.sync_verify_freq = -1: must be 0 (never verify a weight sync) or k >= 1 (every k-th sync)"
            in errors_of(valid_file, "rollout.sync_verify_freq=-1"))
    assert load_config(valid_file, ["rollout.sync_verify_freq=0"]).rollout.sync_verify_freq == 0


def test_sleep_level_is_1_or_2(valid_file: Path) -> None:
    assert "rollout.sleep_level = 3: must be 1 (keep the weights) or 2 (discard them)" in errors_of(valid_file, "rollout.sleep_level=3")


def test_profile_steps_are_step_numbers(valid_file: Path) -> None:
    assert "trainer.profile_steps: 0 is not a step number" in errors_of(valid_file, "trainer.profile_steps=[0,2]")
    assert list(load_config(valid_file, ["trainer.profile_steps=[1,3]"]).trainer.profile_steps) == [1, 3]


def test_hf_config_cannot_contradict_the_checkpoint(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_MODEL))
    path = write(tmp_path, "exp.yaml", dict(VALID, model={"path": str(model_dir), "hf_config": {"num_hidden_layers": 2}}))
    assert "model.hf_config sets ['num_hidden_layers'], which differ from" in errors_of(path)
    same = write(tmp_path, "same.yaml", dict(VALID, model={"path": str(model_dir), "hf_config": {"num_hidden_layers": 4}}))
    assert load_config(same).model.hf_config.num_hidden_layers == 4


def test_sync_probe_keys_are_checked(valid_file: Path) -> None:
    assert ("rollout.probe_freq = -2: must be 0 (no probe) or k >= 1 (after the sync of every k-th weight version)"
            in errors_of(valid_file, "rollout.probe_freq=-2"))
    assert ("rollout.probe_prompts = 0: must be >= 1 (training prompts in the probe batch)"
            in errors_of(valid_file, "rollout.probe_freq=1", "rollout.probe_prompts=0"))
    cfg = load_config(valid_file, ["rollout.probe_freq=5", "rollout.probe_prompts=3"])
    assert (cfg.rollout.probe_freq, cfg.rollout.probe_prompts) == (5, 3)
    assert load_config(valid_file).rollout.probe_freq == 0  # off unless asked for
