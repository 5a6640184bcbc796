"""Cross-field validation of an experiment config, run before any process or worker starts.

Each rule appends a message naming the key(s), the value found and what would be valid; all
problems are reported together in one ConfigError. The rules import nothing heavy (no torch,
transformers or Megatron), so a config error is reported in a fraction of a second; the one check
that needs them (a reward model's checkpoint and tokenizer) runs only once every other rule passed.

`validate_config` runs the rule sections in a fixed order, which is the order of the messages: those
here (names, value ranges, sampling, the rollout engine, inputs, the algorithm's keys against each
other, the model's config) call into `rollout_rules` (multi-turn, chat-template kwargs, old
log-probs) and `algorithm_rules` (optimizers, KL in the reward, DAPO's filter, scorers, reward
model); then come `layout_rules` (parallel layouts, batches, token budgets, rollout TP, positions)
and the asynchronous modes and seeds of `rollout_rules`. `rules` holds the collector and the helpers
they share.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from megarl.config.algorithm_rules import (check_filter_metric, check_optim, check_reward_kl_keys,
                                           check_reward_kwargs, check_reward_model)
from megarl.config.inert_keys import inert_key_errors
from megarl.config.layout_rules import check_layouts, check_positions, check_rollout_tp
from megarl.config.model_files import family_specs
from megarl.config.plugins import import_modules
from megarl.config.rollout_rules import (check_async, check_chat_template_kwargs, check_multi_turn,
                                         check_old_log_probs, check_seeds)
from megarl.config.rules import Rules, critic_enabled, model_hf_config, pool_size, ref_enabled
from megarl.errors import ConfigError


# The built-in names of the algorithm registries (a test keeps them equal); names users register
# are added when megarl.algorithms is already imported (importing it here would load torch).
_BUILTIN_ADV = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "grpo_passk"}
_BUILTIN_POLICY_LOSSES = {"vanilla", "gspo", "cispo", "gpg", "reinforce"}
GROUP_ESTIMATORS = {"grpo", "rloo", "grpo_passk", "reinforce_plus_plus_baseline"}
LOSS_AGG_MODES = {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
_KL_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_TYPES = set(_KL_BASE) | {f"{name}+" for name in _KL_BASE}  # "+": straight-through (gradient of k2)
ENUMS: dict[str, set[str]] = {
    "rollout.engine": {"auto", "vllm", "hf"},
    "rollout.logprobs_mode": {"processed", "raw"},
    "data.truncation": {"error", "left", "right", "middle"},
    "data.apply_chat_template": {"auto", "true", "false", "True", "False"},
    "algorithm.kl_ctrl.type": {"fixed", "adaptive"},
    "actor.optim.lr_scheduler": {"constant", "cosine", "linear"},
    "critic.optim.lr_scheduler": {"constant", "cosine", "linear"},
    "model.dtype": {"fp32", "bf16"},
    "rollout.dtype": {"fp32", "bf16", "fp16", "float32", "bfloat16", "float16"},
    "model.recompute_granularity": {"full", "selective"},
    "model.prompt_sharing": {"auto", "always", "never"},
    "trainer.resume_mode": {"auto", "disable", "resume_path"},
    "resources.device": {"auto", "cpu", "cuda"},
    "resources.cpu_grad_reduce": {"shared_memory", "gloo"},
    "actor.loss_agg_mode": LOSS_AGG_MODES,
    "critic.loss_agg_mode": LOSS_AGG_MODES,
}
TRACKING_BACKENDS = {"console", "jsonl", "mlflow"}
MIN_SAMPLING_TEMPERATURE = 1e-5  # vllm.sampling_params: below it a request is greedy
# HF config keys that change weight shapes: model.override_config cannot set them over a checkpoint.
SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "num_experts",
              "num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size")


_REGISTRIES = {"advantage": (_BUILTIN_ADV, "ADVANTAGE_ESTIMATORS"),
               "policy_loss": (_BUILTIN_POLICY_LOSSES, "POLICY_LOSSES"),
               "kl": (KL_TYPES, "KL_ESTIMATORS")}


def registered_names(kind: str) -> set[str]:
    """Names in the algorithm registries (``advantage``, ``policy_loss`` or ``kl``: each KL estimator also
    with its straight-through ``+``), plus the built-ins."""
    base, attr = _REGISTRIES[kind]
    names = set(getattr(sys.modules.get("megarl.algorithms"), attr, None) or ())
    if kind == "kl":
        names |= {f"{name}+" for name in names}
    return names | base


def model_families() -> set[str]:
    """Family names of the YAMLs in model_specs/ (each file's `family` key)."""
    return set(family_specs())


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError listing every rule ``cfg`` breaks."""
    r = Rules(cfg)
    _import_plugins(r, cfg)  # first: the names these modules register are valid values of the keys checked below
    _check_names(r, cfg)
    _check_values(r, cfg)
    _check_rollout(r, cfg)
    _check_inputs(r, cfg)
    _check_algorithm(r, cfg)
    _check_unread_keys(r, cfg)
    if cfg.reward_model.enable:
        check_reward_model(r, cfg)
    _check_model_config(r, cfg)
    _check_steps_and_dynamic_sampling(r, cfg)

    hf = model_hf_config(cfg)
    world = pool_size(cfg.resources.actor_pool)
    if world < 1:
        r.err(f"resources.actor_pool: nnodes x devices_per_node = {world}: must be >= 1")
        raise ConfigError("invalid config:\n  " + "\n  ".join(r.errors))
    check_layouts(r, cfg, hf, world)
    check_async(r, cfg, world)
    check_seeds(r, cfg, world)
    check_rollout_tp(r, cfg, hf, world)
    check_positions(r, hf, "the model's")

    if r.errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(r.errors))


def _import_plugins(r: Rules, cfg: DictConfig) -> None:
    """algorithm.import_modules: the user's modules that register algorithm names."""
    try:
        import_modules(cfg.algorithm.import_modules)
    except ConfigError as exc:
        r.err(str(exc))


def _check_names(r: Rules, cfg: DictConfig) -> None:
    """Keys whose value is one of a set: the enumerations, the algorithm registries, tracking backends."""
    if cfg.model.dtype == "fp16":
        r.err("model.dtype = 'fp16': training in fp16 needs loss scaling, which megarl does not implement; "
              "use bf16 (or fp32); rollout.dtype may still be fp16")
    else:
        r.one_of("model.dtype", ENUMS["model.dtype"])
    for key, allowed in ENUMS.items():
        if key != "model.dtype":
            r.one_of(key, allowed)
    r.one_of("algorithm.adv_estimator", registered_names("advantage"))
    r.one_of("actor.policy_loss.loss_mode", registered_names("policy_loss"))
    for key in ("actor.kl_loss_type", "algorithm.kl_penalty"):
        r.one_of(key, registered_names("kl"))
    for backend in cfg.tracking.backends:
        if backend not in TRACKING_BACKENDS:
            r.err(f"tracking.backends: unknown backend {backend!r}; valid: {sorted(TRACKING_BACKENDS)}")


def _check_values(r: Rules, cfg: DictConfig) -> None:
    """Numbers within their ranges, the optimizers, and sampling settings both rollout engines honour."""
    rollout = cfg.rollout
    for key in ("rollout.temperature", "actor.clip_ratio", "rollout.n",
                "data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "actor.ppo_epochs",
                "critic.ppo_epochs", "trainer.total_epochs", "actor.optim.clip_grad",
                "reward.timeout_s", "rollout.val_kwargs.n", "critic.cliprange_value", "algorithm.kl_ctrl.horizon"):
        r.positive(key)
    for role in ("actor", "critic"):
        check_optim(r, role)
    keep = cfg.trainer.max_ckpt_to_keep
    if keep is not None and keep < 1:
        r.err(f"trainer.max_ckpt_to_keep = {keep}: must be >= 1 (the checkpoints saved last that are kept), or null "
              "to keep every checkpoint")
    for key in ("rollout.max_num_seqs", "rollout.update_weights_bucket_mb"):
        if OmegaConf.select(cfg, key) < 1:
            r.err(f"{key} = {OmegaConf.select(cfg, key)}: must be >= 1")
    for key in ("actor.clip_ratio_low", "actor.clip_ratio_high", "rollout.response_length", "data.val_batch_size",
                "trainer.total_training_steps", "actor.log_prob_micro_batch_size_per_gpu",
                "ref.log_prob_micro_batch_size_per_gpu", "data.gen_batch_size"):
        r.positive(key)
    for key in ("actor.entropy_coeff", "actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef", "actor.optim.weight_decay",
                "reward.num_workers", "trainer.critic_warmup"):
        r.positive(key, strict=False)
    r.in_range("rollout.top_p", 0.0, 1.0, lo_open=True)
    r.in_range("rollout.val_kwargs.top_p", 0.0, 1.0, lo_open=True)
    for key in ("rollout.top_k", "rollout.val_kwargs.top_k"):
        if OmegaConf.select(cfg, key) < -1:
            r.err(f"{key} = {OmegaConf.select(cfg, key)}: must be -1 or 0 (off) or k >= 1 (keep the k most likely "
                  "tokens)")
    val = rollout.val_kwargs
    if val.do_sample and not val.temperature > 0:
        r.err(f"rollout.val_kwargs.temperature = {val.temperature} with do_sample: true: sampling needs a "
              "temperature > 0; for argmax decoding set do_sample: false")
    # vLLM decodes greedily below this temperature (and then refuses n > 1); the HF engine would sample.
    for key, value in (("rollout.temperature", rollout.temperature),
                       ("rollout.val_kwargs.temperature", val.temperature if val.do_sample else None)):
        if value is not None and 0 < value < MIN_SAMPLING_TEMPERATURE:
            r.err(f"{key} = {value}: below {MIN_SAMPLING_TEMPERATURE:g} vLLM decodes greedily (and refuses n > 1) "
                  "where the HF engine samples; use a temperature >= 1e-5, or argmax decoding (validation: "
                  "val_kwargs.do_sample: false)")
    if not val.do_sample and val.n > 1:
        r.err(f"rollout.val_kwargs.n = {val.n} with do_sample: false: argmax decoding gives n identical responses "
              "(and vLLM refuses n > 1 for greedy requests); set do_sample: true or n: 1")
    if rollout.engine == "hf" and rollout.tensor_model_parallel_size != 1:
        r.err(f"rollout.tensor_model_parallel_size = {rollout.tensor_model_parallel_size} with rollout.engine = "
              "'hf': the HF engine holds the whole model in each process (TP 1); use engine vllm (or auto "
              "where vLLM is installed) for a tensor-parallel rollout")
    r.in_range("algorithm.gamma", 0.0, 1.0)
    r.in_range("algorithm.lam", 0.0, 1.0)
    r.in_range("rollout.gpu_memory_utilization", 0.0, 1.0, lo_open=True)
    r.in_range("reward.max_failure_share", 0.0, 1.0)  # 1.0: a batch of failed calls never stops the run
    r.positive("reward.batch_timeout_s")
    r.positive("reward.worker_memory_mb", strict=False)


def _check_rollout(r: Rules, cfg: DictConfig) -> None:
    """The rollout engine's sleep, sync verification and probe; multi-turn rollouts, chat-template
    kwargs; the old log-probs and the rollout correction; the dual-clip bound on their ratio."""
    actor, rollout = cfg.actor, cfg.rollout
    if rollout.sleep_level not in (1, 2):
        r.err(f"rollout.sleep_level = {rollout.sleep_level}: must be 1 (keep the weights) or 2 (discard them)")
    if rollout.sync_verify_freq < 0:
        r.err(f"rollout.sync_verify_freq = {rollout.sync_verify_freq}: must be 0 (never verify a weight sync) "
              "or k >= 1 (every k-th sync)")
    if rollout.probe_freq < 0:
        r.err(f"rollout.probe_freq = {rollout.probe_freq}: must be 0 (no probe) or k >= 1 (after the sync of "
              "every k-th weight version)")
    if rollout.probe_freq > 0 and rollout.logprobs_mode == "raw" and rollout.temperature != 1.0:
        r.err(f"rollout.probe_freq = {rollout.probe_freq} with rollout.logprobs_mode = 'raw' and rollout.temperature = "
              f"{rollout.temperature}: the probe compares the rollout's log-probs, log_softmax(logits) in raw mode, "
              "with the trainer's log_softmax(logits / temperature); use logprobs_mode processed or temperature 1")
    if rollout.probe_prompts < 1:
        r.err(f"rollout.probe_prompts = {rollout.probe_prompts}: must be >= 1 (training prompts in the probe batch)")
    check_multi_turn(r, rollout.multi_turn)
    check_chat_template_kwargs(r, cfg)
    check_old_log_probs(r, cfg)  # actor.old_log_prob_source, algorithm.rollout_correction, max_logprob_gap
    if actor.clip_ratio_c <= 1.0:
        r.err(f"actor.clip_ratio_c = {actor.clip_ratio_c}: the dual-clip bound must be > 1.0 (verl's default is 3.0)")


def _check_inputs(r: Rules, cfg: DictConfig) -> None:
    """The training data and the model are given."""
    data = cfg.data
    if not data.train_files:
        r.err("data.train_files is empty: give one or more parquet files (`megarl data make arithmetic` writes some)")
    if not cfg.model.path and not cfg.model.hf_config:
        r.err("model: set model.path (a HF model directory) or model.hf_config (a HF config for random init)")
    if cfg.model.path and not Path(cfg.model.path).is_dir() and not cfg.model.hf_config:
        r.err(f"model.path = {cfg.model.path!r}: no such directory")


def _check_algorithm(r: Rules, cfg: DictConfig) -> None:
    """The algorithm against the group size (rollout.n), the roles it needs and their pools, and the
    resume keys against resume_mode."""
    alg, rollout = cfg.algorithm, cfg.rollout
    n = rollout.n
    if alg.adv_estimator in GROUP_ESTIMATORS and n < 2:
        r.err(
            f"rollout.n = {n}: algorithm.adv_estimator = {alg.adv_estimator!r} compares responses within a group, "
            f"so it needs rollout.n >= 2"
        )
    if alg.filter_groups.enable and n < 2:
        r.err(f"rollout.n = {n}: algorithm.filter_groups (DAPO dynamic sampling) needs rollout.n >= 2")
    if alg.adv_estimator == "grpo_passk" and alg.pass_k is not None and not 2 <= alg.pass_k <= n:
        r.err(f"algorithm.pass_k = {alg.pass_k}: must be in [2, rollout.n = {n}] (or null for rollout.n)")
    if alg.adv_estimator == "gae" and cfg.critic.enable is False:
        r.err("critic.enable = false: algorithm.adv_estimator = 'gae' needs a critic (set critic.enable: true or null)")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        r.err("trainer.resume_mode = 'resume_path' needs trainer.resume_from_path")
    if alg.pass_k is not None and alg.adv_estimator != "grpo_passk":
        r.err(f"algorithm.pass_k = {alg.pass_k}: read by algorithm.adv_estimator 'grpo_passk' only, not "
              f"{alg.adv_estimator!r}; remove the key")
    for role, enabled, enabled_by in (("critic", critic_enabled(cfg), "critic.enable, or adv_estimator gae"),
                                      ("ref", ref_enabled(cfg), "ref.enable, or a KL term"),
                                      ("reward_model", bool(cfg.reward_model.enable), "reward_model.enable")):
        if cfg.resources.get(f"{role}_pool") is not None and not enabled:
            r.err(f"resources.{role}_pool is set but the run has no {role} ({enabled_by}); remove the pool or "
                  "enable the role")
    if cfg.trainer.resume_from_path and cfg.trainer.resume_mode != "resume_path":
        r.err(f"trainer.resume_from_path = {cfg.trainer.resume_from_path!r} with trainer.resume_mode = "
              f"'{cfg.trainer.resume_mode}': the path is read with resume_mode 'resume_path' only ('auto' resumes the "
              "newest checkpoint of this run's own directory, 'disable' starts fresh); set trainer.resume_mode: "
              "resume_path or remove the path")
    if cfg.ref.enable is False and (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        uses = [key for key, on in (("actor.use_kl_loss", cfg.actor.use_kl_loss),
                                    ("algorithm.use_kl_in_reward", cfg.algorithm.use_kl_in_reward)) if on]
        r.err(f"ref.enable = false with {' and '.join(f'{key} = true' for key in uses)}: the KL term needs the "
              "reference policy's log-probs; set ref.enable: true (or null: on when a KL term needs it) or turn "
              "the KL term off")


def _check_unread_keys(r: Rules, cfg: DictConfig) -> None:
    """Keys this run would not read (the KL in the reward's, inert keys, the filter's and its metric, the
    scorers' options, resume_fallback, critic_warmup)."""
    check_reward_kl_keys(r, cfg.algorithm)
    for message in inert_key_errors(cfg, critic_on=critic_enabled(cfg), ref_on=ref_enabled(cfg),
                                    builtin_estimators=_BUILTIN_ADV,
                                    builtin_losses=_BUILTIN_POLICY_LOSSES):
        r.err(message)
    check_filter_metric(r, cfg)
    check_reward_kwargs(r, cfg)
    if cfg.trainer.resume_fallback and cfg.trainer.resume_mode != "auto":
        r.err(f"trainer.resume_fallback = true with trainer.resume_mode = '{cfg.trainer.resume_mode}': the fallback "
              "to an earlier checkpoint applies to resume_mode 'auto' only (resume_path resumes the checkpoint it "
              "names or stops); remove it or use resume_mode: auto")
    if cfg.trainer.critic_warmup and not critic_enabled(cfg):
        r.err(f"trainer.critic_warmup = {cfg.trainer.critic_warmup}: steps that train only the critic need one "
              "(critic.enable, or algorithm.adv_estimator 'gae'); without it those steps would train nothing. "
              "Remove the key")


def _check_model_config(r: Rules, cfg: DictConfig) -> None:
    """model.spec names a family; model.hf_config and model.override_config against the checkpoint."""
    if cfg.model.spec is not None:
        families = model_families()
        if cfg.model.spec not in families:
            r.err(f"model.spec = {cfg.model.spec!r}: no such family in model_specs/; valid: {sorted(families)}")
    path_config = Path(cfg.model.path or "") / "config.json"
    if cfg.model.path and not cfg.model.init_from_scratch and path_config.is_file():
        on_disk = json.loads(path_config.read_text())
        differ = sorted(k for k, v in cfg.model.hf_config.items() if on_disk.get(k) != v)
        if differ:
            r.err(f"model.hf_config sets {differ}, which differ from {path_config}: with model.path the checkpoint's "
                  "config is used; remove them, or set model.override_config (keys that keep weight shapes)")
    if cfg.model.path and not cfg.model.init_from_scratch:
        shaped = sorted(k for k in cfg.model.override_config if k in SHAPE_KEYS)
        if shaped:
            r.err(f"model.override_config sets {shaped} over the checkpoint in model.path: these change weight "
                  "shapes; set model.init_from_scratch: true to build a new model, or remove them")


def _check_steps_and_dynamic_sampling(r: Rules, cfg: DictConfig) -> None:
    """trainer.val_only and profile_steps; DAPO's data.gen_batch_size, filter metric and overlong buffer."""
    alg, rollout, data = cfg.algorithm, cfg.rollout, cfg.data
    if cfg.trainer.val_only and not data.val_files:
        r.err("trainer.val_only = true needs data.val_files (there is nothing to validate on)")
    for step in cfg.trainer.profile_steps:
        if not isinstance(step, int) or step < 1:
            r.err(f"trainer.profile_steps: {step!r} is not a step number (integers >= 1)")
    if data.gen_batch_size is not None:
        if not alg.filter_groups.enable:
            r.err("data.gen_batch_size is only used by DAPO dynamic sampling (algorithm.filter_groups.enable: true); "
                  "remove it or enable the filter")
        elif data.gen_batch_size < data.train_batch_size:
            r.err(f"data.gen_batch_size = {data.gen_batch_size}: must be >= data.train_batch_size = {data.train_batch_size}")
    if alg.filter_groups.enable and alg.use_kl_in_reward and alg.filter_groups.metric == "seq_final_reward":
        r.err("algorithm.filter_groups.metric = 'seq_final_reward' with algorithm.use_kl_in_reward: the KL penalty "
              "is computed after dynamic sampling; filter on seq_reward (the scores) or acc")
    if cfg.reward.overlong_buffer.enable:
        buf = cfg.reward.overlong_buffer.len
        resp = rollout.response_length or data.max_response_length
        if not 0 < buf < resp:
            r.err(f"reward.overlong_buffer.len = {buf}: must be in (0, response length = {resp})")
