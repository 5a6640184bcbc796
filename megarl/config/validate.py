"""Cross-field validation of an experiment config, run before any process or worker starts.

Each rule appends a message naming the key(s), the value found and what would be valid; all
problems are reported together in one ConfigError. The rules import nothing heavy (no torch,
transformers or Megatron), so a config error is reported in a fraction of a second; the one check
that needs them (a reward model's checkpoint and tokenizer) runs only once every other rule passed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from megarl.config.chat_template import chat_template_kwargs_errors
from megarl.config.inert_keys import changed_keys, inert_key_errors
from megarl.config.model_files import family_specs
from megarl.config.plugins import import_modules
from megarl.convert import HF_FILES_DIR, MEGATRON_MARKER
from megarl.config.schema import AlgorithmConfig, FilterGroupsConfig, KLControlConfig, TrainerConfig
from megarl.errors import ConfigError
from megarl.layout import VLLM_VOCAB_PADDING
from megarl.rewards.scorers import check_scorer_options  # standard library only, like these rules

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
# Rollout engine r is seeded with trainer.seed x ROLLOUT_SEED_FACTOR + r (megarl.trainer.run_spec).
ROLLOUT_SEED_FACTOR = 1000
# megarl.rewards.model_scores.COMBINES, which imports torch (a test keeps them equal).
REWARD_MODEL_COMBINES = ("by_style", "weighted_sum")
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


def cp_padded_length(length: int, cp: int) -> int:
    """`length` padded for context parallelism: a multiple of 2*CP (1 without CP); the arithmetic of
    megarl.megatron.context_parallel.padded_length, which imports torch (a test keeps them equal)."""
    align = 2 * cp if cp > 1 else 1
    return -(-length // align) * align


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) if n > 0 else "none"


def model_hf_config(cfg: DictConfig) -> Optional[dict[str, Any]]:
    """The HF config of the model: inline ``model.hf_config`` over ``model.path``/config.json."""
    out: dict[str, Any] = {}
    if cfg.model.path:
        cfg_file = Path(cfg.model.path) / "config.json"
        if cfg_file.is_file():
            try:
                out.update(json.loads(cfg_file.read_text()))
            except json.JSONDecodeError as err:
                raise ConfigError(f"model.path: {cfg_file} is not valid JSON: {err}") from err
    out.update(OmegaConf.to_container(cfg.model.hf_config, resolve=True))
    out.update(OmegaConf.to_container(cfg.model.override_config, resolve=True))
    return out or None


def dir_hf_config(r: _Rules, path: str, key: str) -> Optional[dict[str, Any]]:
    """config.json of the HF directory `path` (the value of `key`), or of the source model a converted
    checkpoint keeps (`megarl convert hf-to-mcore`); None when it has none."""
    converted = (Path(path) / MEGATRON_MARKER).is_file()
    config_file = Path(path) / (f"{HF_FILES_DIR}/config.json" if converted else "config.json")
    if not config_file.is_file():
        return None
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        r.err(f"{key}: {config_file} is not valid JSON: {err}")
        return None


class _Rules:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.errors: list[str] = []

    def err(self, msg: str) -> None:
        self.errors.append(msg)

    def positive(self, key: str, strict: bool = True) -> None:
        value = OmegaConf.select(self.cfg, key)
        if value is None:
            return
        if (strict and value <= 0) or (not strict and value < 0):
            self.err(f"{key} = {value}: must be {'> 0' if strict else '>= 0'}")

    def in_range(self, key: str, lo: float, hi: float, lo_open: bool = False) -> None:
        value = OmegaConf.select(self.cfg, key)
        if value is None:
            return
        ok = (lo < value if lo_open else lo <= value) and value <= hi
        if not ok:
            self.err(f"{key} = {value}: must be in {'(' if lo_open else '['}{lo}, {hi}]")

    def one_of(self, key: str, allowed: set[str]) -> None:
        value = OmegaConf.select(self.cfg, key)
        if value is not None and str(value) not in allowed:
            self.err(f"{key} = {value!r}: must be one of {sorted(allowed)}")


def _as_dict(node: Any) -> dict:
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def pool_size(pool: Any) -> int:
    return int(pool.nnodes) * int(pool.devices_per_node)


def role_parallel(cfg: DictConfig, section: str) -> Any:
    """The Megatron layout of `section` ("actor", "critic", "ref"); critic and ref default to the actor's."""
    par = cfg[section].get("megatron") if section != "actor" else cfg.actor.megatron
    return par if par is not None else cfg.actor.megatron


def critic_enabled(cfg: DictConfig) -> bool:
    return cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator == "gae"


def ref_enabled(cfg: DictConfig) -> bool:
    if cfg.ref.enable is not None:
        return bool(cfg.ref.enable)
    return bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


ASYNC_MODES = ("sync", "one_step_off", "bounded_staleness")
PARTIAL_MODES = ("off", "continue", "drop")  # trainer.partial_rollout


def _check_async(r: Any, cfg: Any, world: int) -> None:
    """trainer.async_mode and resources.rollout_pool: what the separate placement supports."""
    mode, pool = cfg.trainer.async_mode, cfg.resources.rollout_pool
    if mode not in ASYNC_MODES:
        extra = (" (for asynchronous generation with partial rollouts: bounded_staleness with "
                 "trainer.partial_rollout; a producer with more than one batch in flight is not built)"
                 if mode in ("fully_async", "async") else "")
        r.err(f"trainer.async_mode = {mode!r}: valid: {', '.join(ASYNC_MODES)}{extra}")
    if pool is not None:
        rollout_world = pool_size(pool)
        if rollout_world != world:
            r.err(f"resources.rollout_pool: {rollout_world} ranks; the rollout pool must have as many ranks as "
                  f"resources.actor_pool ({world}): rollout rank r takes its weights from training rank r")
        if cfg.rollout.free_cache_engine:
            r.err("rollout.free_cache_engine: true with resources.rollout_pool: a rollout pool of its own keeps its "
                  "memory between steps (nothing trains in its processes); set it to false")
    if cfg.trainer.max_staleness < 1:
        r.err(f"trainer.max_staleness = {cfg.trainer.max_staleness}: must be >= 1 (a row generated during the "
              "previous step is already one version old)")
    elif cfg.trainer.max_staleness != 1 and mode != "bounded_staleness":
        r.err(f"trainer.max_staleness = {cfg.trainer.max_staleness} is used only by trainer.async_mode "
              f"bounded_staleness (async_mode is {mode!r}); remove it or set that mode")
    _check_partial_rollout(r, cfg)
    if mode in ("one_step_off", "bounded_staleness"):
        if pool is None:
            r.err(f"trainer.async_mode = {mode!r} needs resources.rollout_pool: generation can overlap the "
                  "update only in processes of its own (with the rollout in the actor's processes it waits anyway)")
        if cfg.algorithm.filter_groups.enable:
            r.err(f"trainer.async_mode = {mode!r} with algorithm.filter_groups.enable: DAPO's dynamic sampling "
                  "generates a varying number of batches per step; use async_mode sync")
        if not cfg.rollout.calculate_log_probs:
            r.err(f"trainer.async_mode = {mode!r} needs rollout.calculate_log_probs: true: the rows are generated "
                  "with older weights, and their rollout log-probs are what the off-policy correction and the "
                  "mismatch metrics compare against")


def _check_reward_kl_keys(r: Any, alg: Any) -> None:
    """algorithm.kl_penalty and algorithm.kl_ctrl.* shape the KL penalty in the reward only: refused when set
    without algorithm.use_kl_in_reward, and the adaptive controller's keys with a fixed one (they would do
    nothing). A key counts as set when it differs from its default."""
    defaults = KLControlConfig()
    if not alg.use_kl_in_reward:
        changed = [f"algorithm.kl_ctrl.{key} = {alg.kl_ctrl[key]!r}" for key in ("type", "kl_coef", "target_kl", "horizon")
                   if alg.kl_ctrl[key] != getattr(defaults, key)]
        if alg.kl_penalty != AlgorithmConfig.kl_penalty:
            changed.insert(0, f"algorithm.kl_penalty = {alg.kl_penalty!r}")
        if changed:
            r.err(f"{', '.join(changed)} without algorithm.use_kl_in_reward: these shape the KL penalty in the "
                  "reward only (the KL loss takes actor.kl_loss_type and actor.kl_loss_coef); set "
                  "algorithm.use_kl_in_reward: true or remove them")
    elif alg.kl_ctrl.type == "fixed":
        changed = [f"algorithm.kl_ctrl.{key} = {alg.kl_ctrl[key]!r}" for key in ("target_kl", "horizon")
                   if alg.kl_ctrl[key] != getattr(defaults, key)]
        if changed:
            r.err(f"{', '.join(changed)} with algorithm.kl_ctrl.type = 'fixed': only the adaptive controller "
                  "reads them (the fixed one keeps kl_coef); set type: adaptive or remove them")
    elif alg.kl_ctrl.target_kl <= 0:
        r.err(f"algorithm.kl_ctrl.target_kl = {alg.kl_ctrl.target_kl} with algorithm.kl_ctrl.type = 'adaptive': "
              "must be > 0 (the controller moves kl_coef by the measured KL / target_kl - 1)")


def _check_partial_rollout(r: Any, cfg: Any) -> None:
    """trainer.partial_rollout*: a chunked generation of the pipelined modes, single-turn."""
    t = cfg.trainer
    if t.partial_rollout not in PARTIAL_MODES:
        r.err(f"trainer.partial_rollout = {t.partial_rollout!r}: valid: {', '.join(PARTIAL_MODES)}")
        return
    if t.partial_rollout_chunk_tokens < 1:
        r.err(f"trainer.partial_rollout_chunk_tokens = {t.partial_rollout_chunk_tokens}: must be >= 1")
    if t.partial_rollout_interrupt_after is not None and t.partial_rollout_interrupt_after < 1:
        r.err(f"trainer.partial_rollout_interrupt_after = {t.partial_rollout_interrupt_after}: must be >= 1 chunk, "
              "or null (interrupt when the update is done)")
    if t.partial_rollout == "off":
        if t.partial_rollout_chunk_tokens != TrainerConfig.partial_rollout_chunk_tokens:
            r.err(f"trainer.partial_rollout_chunk_tokens = {t.partial_rollout_chunk_tokens} with "
                  "trainer.partial_rollout = 'off': each row is generated whole, in no chunks; set "
                  "trainer.partial_rollout (continue | drop) or remove the key")
        if t.partial_rollout_interrupt_after is not None:
            r.err(f"trainer.partial_rollout_interrupt_after = {t.partial_rollout_interrupt_after} with "
                  "trainer.partial_rollout = 'off': nothing is generated in chunks to interrupt; set "
                  "trainer.partial_rollout (continue | drop) or remove the key")
        return
    if t.async_mode == "sync":
        r.err(f"trainer.partial_rollout = {t.partial_rollout!r} with trainer.async_mode = 'sync': only a generation "
              "that overlaps an update can be interrupted by it; set async_mode one_step_off or bounded_staleness")
    if cfg.rollout.multi_turn.enable:
        r.err(f"trainer.partial_rollout = {t.partial_rollout!r} with rollout.multi_turn.enable: multi-turn episodes "
              "are not interrupted by new weights (not built); set partial_rollout off")


def _check_layout(r: _Rules, role: str, par: Any, world: int, pool_key: str, hf: Optional[dict]) -> int:
    """Check one role's Megatron layout against its pool; return the derived DP size (0 if invalid)."""
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    cp, ep = par.context_parallel_size, par.expert_model_parallel_size
    for name, value in (("tensor", tp), ("pipeline", pp), ("context", cp), ("expert", ep)):
        if value < 1:
            r.err(f"{role}.megatron.{name}_model_parallel_size = {value}: must be >= 1")
            return 0
    model_par = tp * pp * cp
    if world % model_par != 0:
        r.err(
            f"{role}.megatron: TP x PP x CP = {tp} x {pp} x {cp} = {model_par} does not divide the "
            f"{world} devices of {pool_key} (nnodes x devices_per_node); valid products: {_divisors(world)}"
        )
        return 0
    dp = world // model_par
    if par.data_parallel_size is not None and par.data_parallel_size != dp:
        r.err(
            f"{role}.megatron.data_parallel_size = {par.data_parallel_size}: TP x PP x CP x DP must equal the "
            f"{world} devices of {pool_key}, so DP must be {dp} (or null to derive it)"
        )
    etp = par.expert_tensor_parallel_size
    if etp is None or etp == tp:
        if (dp * cp) % ep != 0:
            r.err(f"{role}.megatron.expert_model_parallel_size = {ep}: must divide DP x CP = {dp * cp}")
    elif etp < 1:
        r.err(f"{role}.megatron.expert_tensor_parallel_size = {etp}: must be >= 1 (or null: the tensor parallel size)")
        etp = None
    elif (tp * cp * dp) % (etp * ep) != 0:
        r.err(f"{role}.megatron: expert_tensor_parallel_size x expert_model_parallel_size = {etp} x {ep} must divide "
              f"the TP x CP x DP = {tp * cp * dp} ranks of a pipeline stage (Megatron's expert groups)")
    if par.sequence_parallel and tp == 1:
        r.err(f"{role}.megatron.sequence_parallel = true needs tensor_model_parallel_size > 1")
    if hf:
        heads = hf.get("num_attention_heads")
        groups = hf.get("num_key_value_heads") or heads
        if heads and heads % tp != 0:
            r.err(
                f"{role}.megatron.tensor_model_parallel_size = {tp}: must divide the model's "
                f"num_attention_heads = {heads}; valid: {_divisors(heads)}"
            )
        if groups and groups % tp != 0:
            r.err(
                f"{role}.megatron.tensor_model_parallel_size = {tp}: must divide the model's query groups "
                f"(num_key_value_heads = {groups}); valid: {_divisors(groups)}"
            )
        layers = hf.get("num_hidden_layers")
        if layers and layers % pp != 0:
            r.err(
                f"{role}.megatron.pipeline_model_parallel_size = {pp}: must divide num_hidden_layers = {layers}; "
                f"valid: {_divisors(layers)}"
            )
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        if ep > 1 and not experts:
            r.err(f"{role}.megatron.expert_model_parallel_size = {ep}: the model has no experts; use 1")
        elif experts and experts % ep != 0:
            r.err(f"{role}.megatron.expert_model_parallel_size = {ep}: must divide num_experts = {experts}; valid: {_divisors(experts)}")
        if etp is not None and etp != tp:
            width = hf.get("moe_intermediate_size")
            if not experts:
                r.err(f"{role}.megatron.expert_tensor_parallel_size = {etp}: the model has no experts; leave it null")
            elif width and width % etp != 0:
                r.err(f"{role}.megatron.expert_tensor_parallel_size = {etp}: must divide the model's "
                      f"moe_intermediate_size = {width}; valid: {_divisors(width)}")
    return dp


def is_moe(hf: Optional[dict]) -> bool:
    """Whether the HF config `hf` describes a mixture-of-experts model."""
    return bool(hf and (hf.get("num_local_experts") or hf.get("num_experts")))


def _check_moe(r: _Rules, trained: list[tuple[str, Any]]) -> None:
    """What a mixture-of-experts model cannot do in `megarl train` yet (see README, Models), for the
    trained roles `(role, megatron layout)` whose model has experts."""
    for role, par in trained:
        if par.tensor_model_parallel_size > 1 and not par.sequence_parallel:
            r.err(f"{role}.megatron.tensor_model_parallel_size = {par.tensor_model_parallel_size}: training a "
                  f"mixture-of-experts model with TP > 1 needs {role}.megatron.sequence_parallel: true (Megatron "
                  "requires it), or use TP 1 and split the experts with expert_model_parallel_size")
    # An expert-parallel actor (EP > 1) is resharded into the rollout engine, and at rollout TP > 1
    # the experts land in vLLM's fused expert parameters (megarl.hybrid.sync).


def _check_prompt_sharing(r: _Rules, cfg: DictConfig) -> None:
    """model.prompt_sharing: always, in the layouts where the engine cannot share a prompt."""
    roles = ["actor"] + (["critic"] if critic_enabled(cfg) else []) + (["ref"] if ref_enabled(cfg) else [])
    for role in roles:
        par = role_parallel(cfg, role)
        for name, value in (("context_model_parallel_size", par.context_parallel_size),
                            ("pipeline_model_parallel_size", par.pipeline_model_parallel_size)):
            if value > 1:
                r.err(f"model.prompt_sharing = always: not implemented with {role}.megatron.{name} = {value}; "
                      "use auto (shares where it can) or never")
        if par.sequence_parallel:
            r.err(f"model.prompt_sharing = always: not implemented with {role}.megatron.sequence_parallel; "
                  "use auto (shares where it can) or never")


def _check_batches(r: _Rules, role: str, sec: Any, train_bs: int, n: int, dp: int) -> None:
    mini = sec.ppo_mini_batch_size
    if mini < 1:
        r.err(f"{role}.ppo_mini_batch_size = {mini}: must be >= 1")
        return
    if train_bs % mini != 0:
        r.err(
            f"{role}.ppo_mini_batch_size = {mini} must divide data.train_batch_size = {train_bs} "
            f"(both count prompts); valid: {_divisors(train_bs)}"
        )
    seqs = mini * n
    if dp and seqs % dp != 0:
        r.err(
            f"{role}.ppo_mini_batch_size x rollout.n = {mini} x {n} = {seqs} sequences must be divisible by the "
            f"data-parallel size {dp}"
        )
    elif dp and not sec.use_dynamic_bsz:
        per_rank = seqs // dp
        micro = sec.ppo_micro_batch_size_per_gpu
        if micro < 1 or per_rank % micro != 0:
            r.err(
                f"{role}.ppo_micro_batch_size_per_gpu = {micro} must divide the {per_rank} sequences a mini-batch "
                f"gives each of the {dp} DP ranks; valid: {_divisors(per_rank)}"
            )


def _check_token_budget(r: _Rules, role: str, sec: Any, par: Any, seq_len: int, layout: str = "") -> None:
    """With dynamic micro-batching the budget `ppo_max_token_len_per_gpu` is per rank: under context
    parallelism a sequence is padded to a multiple of 2*CP and each CP rank computes 1/CP of it.
    `layout` names another role's layout `par` is (the reference's pass takes the actor's budget)."""
    if not sec.get("use_dynamic_bsz", False):
        return
    cp = max(int(par.context_parallel_size), 1)
    per_rank = cp_padded_length(seq_len, cp) // cp
    budget = sec.ppo_max_token_len_per_gpu
    if budget < per_rank:
        share = f" at context_parallel_size = {cp}, {per_rank} positions per rank" if cp > 1 else ""
        share += f" in {layout}" if layout else ""
        r.err(
            f"{role}.ppo_max_token_len_per_gpu = {budget}: smaller than the longest sequence "
            f"(max_prompt_length + response length = {seq_len} tokens{share}); set it to at least {per_rank}"
        )


def _check_reward_model(r: _Rules, cfg: DictConfig) -> None:
    """`reward_model.*`: combine, layout and pool (its checkpoint: run_files.reward_model_checkpoint_problems)."""
    rm, res = cfg.reward_model, cfg.resources
    if rm.combine not in REWARD_MODEL_COMBINES:
        r.err(f"reward_model.combine = {rm.combine!r}; valid: {list(REWARD_MODEL_COMBINES)}")
    r.positive("reward_model.micro_batch_size_per_gpu")
    if not rm.model_path:
        r.err("reward_model.enable = true needs reward_model.model_path (a HF sequence-classification directory "
              "with one label)")
        return
    hf = dir_hf_config(r, rm.model_path, "reward_model.model_path")
    world = pool_size(res.reward_model_pool) if res.reward_model_pool is not None else pool_size(res.actor_pool)
    pool_key = "resources.reward_model_pool" if res.reward_model_pool is not None else "resources.actor_pool"
    _check_layout(r, "reward_model", role_parallel(cfg, "reward_model"), world, pool_key, hf)
    if res.reward_model_pool is None and rm.megatron is not None and _as_dict(rm.megatron) != _as_dict(cfg.actor.megatron):
        r.err("reward_model.megatron differs from actor.megatron, but the reward model shares the actor's processes "
              "(resources.reward_model_pool is null); set reward_model.megatron to null (the actor's layout) or "
              "give the reward model its own pool")


def _check_positions(r: _Rules, hf: Optional[dict], whose: str, source: str = "") -> None:
    """The longest sequence (prompt + response) within the positions of the model `hf` (`whose`, read
    from `source`)."""
    max_pos = (hf or {}).get("max_position_embeddings")
    data = r.cfg.data
    resp = r.cfg.rollout.response_length or data.max_response_length
    if max_pos and data.max_prompt_length + resp > max_pos:
        r.err(f"data.max_prompt_length + response length = {data.max_prompt_length} + {resp} exceeds {whose} "
              f"max_position_embeddings = {max_pos}{f' ({source})' if source else ''}")


def _check_optim(r: _Rules, role: str) -> None:
    """`<role>.optim.*`: what Megatron's Adam and its LR schedule (megarl.megatron.optim) accept."""
    key, optim = f"{role}.optim", r.cfg[role].optim
    if optim.lr < 0:
        r.err(f"{key}.lr = {optim.lr}: must be >= 0")
    if optim.min_lr < 0:
        r.err(f"{key}.min_lr = {optim.min_lr}: must be >= 0")
    elif optim.min_lr > optim.lr >= 0:
        r.err(f"{key}.min_lr = {optim.min_lr}: must be <= {key}.lr = {optim.lr} (the decay goes from lr down to "
              "min_lr)")
    if optim.lr_warmup_steps == -1:
        r.err(f"{key}.lr_warmup_steps = -1: verl's 'use lr_warmup_steps_ratio' is 0 in megarl (0: warm up over "
              "lr_warmup_steps_ratio x the schedule's steps); set 0")
    elif optim.lr_warmup_steps < 0:
        r.err(f"{key}.lr_warmup_steps = {optim.lr_warmup_steps}: must be >= 0 (0: lr_warmup_steps_ratio x the "
              "schedule's steps)")
    if not 0 <= optim.lr_warmup_steps_ratio < 1:
        r.err(f"{key}.lr_warmup_steps_ratio = {optim.lr_warmup_steps_ratio}: must be in [0, 1) (the share of the "
              "schedule's steps spent warming up)")
    elif optim.lr_warmup_steps > 0 and optim.lr_warmup_steps_ratio != 0:
        r.err(f"{key}.lr_warmup_steps_ratio = {optim.lr_warmup_steps_ratio} with {key}.lr_warmup_steps = "
              f"{optim.lr_warmup_steps}: the steps are used and the ratio is never read; remove one of them")
    if optim.lr_scheduler == "constant" and optim.min_lr != 0 and not optim.min_lr > optim.lr >= 0:
        r.err(f"{key}.min_lr = {optim.min_lr} with {key}.lr_scheduler = 'constant': only a decaying schedule "
              "(cosine, linear) reads it; remove it or set lr_scheduler")
    betas = list(optim.betas)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        r.err(f"{key}.betas = {betas}: must be a list of 2 numbers in [0, 1) (Adam's beta1 and beta2, e.g. "
              "[0.9, 0.999])")
    if not optim.eps > 0:
        r.err(f"{key}.eps = {optim.eps}: must be > 0 (Adam's denominator term, e.g. 1e-8)")


# What `algorithm.filter_groups.metric` can name (megarl.algorithms.dapo.sequence_metric): a per-response
# sum (dapo.TENSOR_METRICS; dapo imports torch, a test keeps them equal) or a key of the rows'
# reward_info. The built-in scorers return score, acc and format (megarl.rewards.scorers), the reward
# manager adds failed; overlong shaping adds overlong_penalty, multi-turn rollouts tool_reward, and a
# reward model rm_score (megarl.rewards.model_scores.combine_scores).
FILTER_SUMS = ("seq_reward", "seq_final_reward")
BUILTIN_REWARD_INFO = ("score", "acc", "format", "failed")


def filter_metrics(cfg: DictConfig) -> list[str]:
    """The values of algorithm.filter_groups.metric that the built-in scorers (and a reward model) give."""
    if cfg.reward_model.enable:
        # The rule scorers' keys are 0 on the rows the reward model scores alone: not a metric of those rows.
        return [*FILTER_SUMS, "rm_score"]
    names = [*FILTER_SUMS, *BUILTIN_REWARD_INFO]
    if cfg.reward.overlong_buffer.enable:
        names.append("overlong_penalty")
    if cfg.rollout.multi_turn.enable:
        names.append("tool_reward")
    return names


def _check_filter_metric(r: _Rules, cfg: DictConfig) -> None:
    """algorithm.filter_groups.metric: one the run's scoring computes for every row."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        changed = changed_keys("algorithm.filter_groups", fg, FilterGroupsConfig, skip=("enable",))
        if changed:
            r.err(f"{', '.join(changed)} without algorithm.filter_groups.enable: only DAPO's dynamic sampling "
                  "reads them; remove them or enable it")
        return
    valid = filter_metrics(cfg)
    if fg.metric in valid:
        return
    if cfg.reward_model.enable:
        r.err(f"algorithm.filter_groups.metric = {fg.metric!r} with reward_model.enable: a row the reward model "
              "scores alone (reward_model.style 'model') carries 0 in the rule scorer's keys, so every such group "
              "would look uniform and be dropped; use seq_reward (each response's combined score); valid: "
              f"{valid}")
    elif not cfg.reward.custom_reward_function.path:  # a custom function may return any key
        r.err(f"algorithm.filter_groups.metric = {fg.metric!r}: the built-in scorers do not compute it; valid: "
              f"{valid} (a custom reward function, reward.custom_reward_function.path, may return other keys)")


def _check_reward_kwargs(r: _Rules, cfg: DictConfig) -> None:
    """reward.reward_kwargs against the built-in scorers' options (with a custom function they are its own)."""
    if cfg.reward.custom_reward_function.path:
        return
    options = _as_dict(cfg.reward.reward_kwargs)
    for name, value in options.items():
        if not isinstance(value, dict):
            r.err(f"reward.reward_kwargs.{name} = {value!r}: must be a mapping of the scorer's options, e.g. "
                  "{arithmetic: {mode: startswith}}")
            return
    try:
        check_scorer_options(options)
    except ConfigError as exc:
        msg = str(exc)
        r.err(f"reward.{msg}" if msg.startswith("reward_kwargs") else f"reward.reward_kwargs: {msg}")


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError listing every rule ``cfg`` breaks."""
    r = _Rules(cfg)
    alg, actor, rollout, data = cfg.algorithm, cfg.actor, cfg.rollout, cfg.data
    try:  # first: the names these modules register are valid values of the keys checked below
        import_modules(alg.import_modules)
    except ConfigError as exc:
        r.err(str(exc))

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

    for key in ("rollout.temperature", "actor.clip_ratio", "rollout.n",
                "data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "actor.ppo_epochs",
                "critic.ppo_epochs", "trainer.total_epochs", "actor.optim.clip_grad",
                "reward.timeout_s", "rollout.val_kwargs.n", "critic.cliprange_value", "algorithm.kl_ctrl.horizon"):
        r.positive(key)
    for role in ("actor", "critic"):
        _check_optim(r, role)
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
    _check_multi_turn(r, rollout.multi_turn)
    _check_chat_template_kwargs(r, cfg)
    _check_old_log_probs(r, cfg)  # actor.old_log_prob_source, algorithm.rollout_correction, max_logprob_gap
    if actor.clip_ratio_c <= 1.0:
        r.err(f"actor.clip_ratio_c = {actor.clip_ratio_c}: the dual-clip bound must be > 1.0 (verl's default is 3.0)")

    if not data.train_files:
        r.err("data.train_files is empty: give one or more parquet files (`megarl data make arithmetic` writes some)")
    if not cfg.model.path and not cfg.model.hf_config:
        r.err("model: set model.path (a HF model directory) or model.hf_config (a HF config for random init)")
    if cfg.model.path and not Path(cfg.model.path).is_dir() and not cfg.model.hf_config:
        r.err(f"model.path = {cfg.model.path!r}: no such directory")

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
    _check_reward_kl_keys(r, cfg.algorithm)
    for message in inert_key_errors(cfg, critic_on=critic_enabled(cfg), ref_on=ref_enabled(cfg),
                                    builtin_estimators=_BUILTIN_ADV,
                                    builtin_losses=_BUILTIN_POLICY_LOSSES):
        r.err(message)
    _check_filter_metric(r, cfg)
    _check_reward_kwargs(r, cfg)
    if cfg.trainer.resume_fallback and cfg.trainer.resume_mode != "auto":
        r.err(f"trainer.resume_fallback = true with trainer.resume_mode = '{cfg.trainer.resume_mode}': the fallback "
              "to an earlier checkpoint applies to resume_mode 'auto' only (resume_path resumes the checkpoint it "
              "names or stops); remove it or use resume_mode: auto")
    if cfg.trainer.critic_warmup and not critic_enabled(cfg):
        r.err(f"trainer.critic_warmup = {cfg.trainer.critic_warmup}: steps that train only the critic need one "
              "(critic.enable, or algorithm.adv_estimator 'gae'); without it those steps would train nothing. "
              "Remove the key")
    if cfg.reward_model.enable:
        _check_reward_model(r, cfg)
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

    hf = model_hf_config(cfg)
    world = pool_size(cfg.resources.actor_pool)
    if world < 1:
        r.err(f"resources.actor_pool: nnodes x devices_per_node = {world}: must be >= 1")
        raise ConfigError("invalid config:\n  " + "\n  ".join(r.errors))
    dp = _check_layout(r, "actor", actor.megatron, world, "resources.actor_pool", hf)
    _check_batches(r, "actor", actor, data.train_batch_size, n, dp)
    seq_len = data.max_prompt_length + (rollout.response_length or data.max_response_length)
    if dp:
        _check_token_budget(r, "actor", actor, actor.megatron, seq_len)
    if ref_enabled(cfg) and cfg.ref.megatron is not None:  # its pass splits by the actor's budget
        _check_token_budget(r, "actor", actor, cfg.ref.megatron, seq_len, layout="the reference's layout (ref.megatron)")

    if critic_enabled(cfg):
        pool_key = "resources.critic_pool" if cfg.resources.critic_pool is not None else "resources.actor_pool"
        critic_world = pool_size(cfg.resources.critic_pool) if cfg.resources.critic_pool is not None else world
        # A critic.model_path is loaded with its own config.json (model.override_config is the actor's).
        critic_hf = dir_hf_config(r, cfg.critic.model_path, "critic.model_path") if cfg.critic.model_path else hf
        critic_dp = _check_layout(r, "critic", role_parallel(cfg, "critic"), critic_world, pool_key, critic_hf)
        if cfg.resources.critic_pool is None and cfg.critic.megatron is not None and _as_dict(cfg.critic.megatron) != _as_dict(actor.megatron):
            r.err("critic.megatron differs from actor.megatron, but the critic shares the actor's processes "
                  "(resources.critic_pool is null); set critic.megatron to null (the actor's layout) or give the critic its own pool")
        _check_batches(r, "critic", cfg.critic, data.train_batch_size, n, critic_dp)
        if critic_dp:
            _check_token_budget(r, "critic", cfg.critic, role_parallel(cfg, "critic"), seq_len)
        if cfg.critic.model_path:
            _check_positions(r, critic_hf, "the critic's", f"critic.model_path: {cfg.critic.model_path}")
    moe_roles = [("actor", actor.megatron)] if is_moe(hf) else []
    if critic_enabled(cfg) and is_moe(critic_hf):
        moe_roles.append(("critic", role_parallel(cfg, "critic")))
    _check_moe(r, moe_roles)
    if cfg.model.prompt_sharing == "always":
        _check_prompt_sharing(r, cfg)
    if ref_enabled(cfg):
        ref_world = pool_size(cfg.resources.ref_pool) if cfg.resources.ref_pool is not None else world
        pool_key = "resources.ref_pool" if cfg.resources.ref_pool is not None else "resources.actor_pool"
        _check_layout(r, "ref", role_parallel(cfg, "ref"), ref_world, pool_key, hf)
        if cfg.resources.ref_pool is None and cfg.ref.megatron is not None and _as_dict(cfg.ref.megatron) != _as_dict(actor.megatron):
            r.err("ref.megatron differs from actor.megatron, but the reference shares the actor's processes "
                  "(resources.ref_pool is null); set ref.megatron to null (the actor's layout) or give the reference its own pool")

    _check_async(r, cfg, world)
    _check_seeds(r, cfg, world)
    rtp = rollout.tensor_model_parallel_size
    if rtp < 1 or world % rtp != 0:
        where = ("the rollout pool has as many ranks" if cfg.resources.rollout_pool is not None
                 else "the rollout shares the actor's devices")
        r.err(
            f"rollout.tensor_model_parallel_size = {rtp}: must divide the {world} devices of resources.actor_pool "
            f"({where}); valid: {_divisors(world)}"
        )
    elif hf:
        heads = hf.get("num_attention_heads")
        if heads and heads % rtp != 0:
            r.err(f"rollout.tensor_model_parallel_size = {rtp}: must divide num_attention_heads = {heads}; valid: {_divisors(heads)}")
        _check_rollout_tp_shards(r, hf, rtp)

    _check_positions(r, hf, "the model's")

    if r.errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(r.errors))


def _check_rollout_tp_shards(r: Any, hf: dict, rtp: int) -> None:
    """The rest of what the weight sync's plan needs of the rollout's tensor parallelism
    (megarl.hybrid.slices): key/value heads split over the ranks or each replicated over a whole
    number of them, and the MLP's, the experts' and the padded vocabulary's rows split evenly."""
    if rtp <= 1:
        return
    key = f"rollout.tensor_model_parallel_size = {rtp}"
    kv_heads = hf.get("num_key_value_heads") or hf.get("num_attention_heads")
    if kv_heads and kv_heads % rtp != 0 and rtp % kv_heads != 0:
        r.err(f"{key}: must divide num_key_value_heads = {kv_heads} ({_divisors(kv_heads)}) or be a "
              "multiple of it (each key/value head then replicated over the ranks)")
    for size_key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        size = hf.get(size_key)
        if size and size % rtp != 0:
            r.err(f"{key}: must divide {size_key} = {size}; valid: {_divisors(size)}")
    vocab = hf.get("vocab_size")
    if vocab:
        padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        if padded % rtp != 0:
            r.err(f"{key}: must divide the vocabulary padded to a multiple of {VLLM_VOCAB_PADDING} "
                  f"({vocab} -> {padded}); valid: {_divisors(padded)}")


# Built-in names of megarl.agent.tools.BUILTIN_TOOLS and megarl.agent.parsers (a test keeps them equal).
MULTI_TURN_TOOLS = {"calculator", "code_interpreter"}
MULTI_TURN_FORMATS = {"hermes"}
TRUNCATE_SIDES = ("left", "middle", "right")  # megarl.agent.loop.cut_tool_output's sides


def _check_multi_turn(r: Any, multi_turn: Any) -> None:
    """`rollout.multi_turn.*`: limits positive; tools named (built-ins, or "package.module:ClassName")."""
    for key in ("max_turns", "tool_timeout_s", "max_parallel_calls", "max_tool_response_chars"):
        r.positive(f"rollout.multi_turn.{key}")
    if not multi_turn.enable:
        return
    if not multi_turn.tools:
        r.err("rollout.multi_turn.tools is empty: name the tools the model may call "
              f"(built in: {sorted(MULTI_TURN_TOOLS)}, or 'package.module:ClassName')")
    for name in multi_turn.tools:
        if name not in MULTI_TURN_TOOLS and ":" not in str(name):
            r.err(f"rollout.multi_turn.tools: unknown tool {name!r}; built in: {sorted(MULTI_TURN_TOOLS)}, "
                  "or a megarl.agent.tools.Tool subclass as 'package.module:ClassName'")
    if multi_turn.enable and r.cfg.rollout.ignore_eos:
        r.err("rollout.ignore_eos = true with rollout.multi_turn.enable: a turn ends on EOS before its tool calls run, "
              "and with ignore_eos none does (every episode would be one turn that runs to the length limit, no tool "
              "called); set ignore_eos false")
    if multi_turn.tool_response_truncate_side not in TRUNCATE_SIDES:
        r.err(f"rollout.multi_turn.tool_response_truncate_side = {multi_turn.tool_response_truncate_side!r}: must be "
              f"one of {list(TRUNCATE_SIDES)} (the part of a cut tool output the model reads)")
    if multi_turn.format not in MULTI_TURN_FORMATS:
        r.err(f"rollout.multi_turn.format = {multi_turn.format!r}: must be one of {sorted(MULTI_TURN_FORMATS)}")


def _check_chat_template_kwargs(r: _Rules, cfg: DictConfig) -> None:
    """data.apply_chat_template_kwargs: extra arguments of the chat template, read where it renders the
    prompts (data.apply_chat_template auto or true) and the tool turns (rollout.multi_turn.enable)."""
    kwargs = _as_dict(cfg.data.apply_chat_template_kwargs)
    if not kwargs:
        return
    for message in chat_template_kwargs_errors(kwargs):
        r.err(message)
    if str(cfg.data.apply_chat_template).strip().lower() == "false" and not cfg.rollout.multi_turn.enable:
        r.err(f"data.apply_chat_template_kwargs = {kwargs!r} with data.apply_chat_template = "
              f"{cfg.data.apply_chat_template!r} and no multi-turn rollout: no chat template is applied, nothing "
              "reads them; set data.apply_chat_template auto or true (or rollout.multi_turn.enable), or remove them")


def _check_seeds(r: _Rules, cfg: DictConfig, world: int) -> None:
    """data.seed and trainer.seed where their generators refuse them. data.seed orders the data
    (numpy's default_rng: integers >= 0). trainer.seed seeds torch (any integer) and, times 1000 plus the
    rank, vLLM's engines, which seed numpy's legacy generator with it (0 .. 2**32 - 1); `auto` may pick vLLM."""
    if cfg.data.seed < 0:
        r.err(f"data.seed = {cfg.data.seed}: must be an integer >= 0 (numpy's generator, which orders the data, "
              "takes no negative seed)")
    seed, engine = cfg.trainer.seed, cfg.rollout.engine
    highest = (2**32 - world) // ROLLOUT_SEED_FACTOR
    if engine in ("auto", "vllm") and not 0 <= seed <= highest:
        r.err(f"trainer.seed = {seed} with rollout.engine = {engine!r}: must be in [0, {highest}] (vLLM seeds its "
              f"engines with trainer.seed x {ROLLOUT_SEED_FACTOR} + rank, which numpy takes in [0, 2**32 - 1]); or "
              "rollout.engine: hf")


# megarl.workers.losses.OLD_LOG_PROB_SOURCES (+ auto) and megarl.algorithms.rollout_correction's
# CORRECTION_MODES / CORRECTION_LEVELS, which import torch (a test keeps them equal).
OLD_LOG_PROB_SOURCES = ("auto", "recompute", "update", "rollout")
CORRECTION_MODES = ("none", "tis", "mis", "icepop", "reject")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
RATIO_LOSSES = {"vanilla", "gspo", "cispo"}  # policy losses whose ratio is taken against the old log-probs


def optimizer_steps_per_step(cfg: DictConfig, role_cfg: Any) -> int:
    """Optimizer steps a trained role (`cfg.actor`, `cfg.critic`) takes in one trainer step:
    `ppo_epochs` passes over the step's `data.train_batch_size` prompts in mini-batches of
    `ppo_mini_batch_size` prompts (which divides it: `_check_batches`)."""
    return int(role_cfg.ppo_epochs) * (int(cfg.data.train_batch_size) // int(role_cfg.ppo_mini_batch_size))


def update_is_on_policy(cfg: DictConfig) -> bool:
    """The policy cannot change between generation and the actor's update: one optimizer step, one PPO
    epoch of one mini-batch holding the whole batch (so the update's own log-probs are the old ones)."""
    return optimizer_steps_per_step(cfg, cfg.actor) == 1


def _check_old_log_probs(r: _Rules, cfg: DictConfig) -> None:
    actor, corr, rollout = cfg.actor, cfg.algorithm.rollout_correction, cfg.rollout
    source = actor.old_log_prob_source
    r.one_of("actor.old_log_prob_source", set(OLD_LOG_PROB_SOURCES))
    r.one_of("algorithm.rollout_correction.mode", set(CORRECTION_MODES))
    r.one_of("algorithm.rollout_correction.level", set(CORRECTION_LEVELS))
    if source == "update" and not update_is_on_policy(cfg):
        r.err(f"actor.old_log_prob_source = 'update' needs an on-policy update (actor.ppo_epochs = 1 and "
              f"actor.ppo_mini_batch_size = data.train_batch_size), found ppo_epochs = {actor.ppo_epochs}, "
              f"ppo_mini_batch_size = {actor.ppo_mini_batch_size}, train_batch_size = {cfg.data.train_batch_size}; "
              "use recompute or auto")
    if source == "update" and cfg.algorithm.use_kl_in_reward:
        r.err("actor.old_log_prob_source = 'update' with algorithm.use_kl_in_reward: the KL in the reward needs "
              "the old log-probs before the update; use recompute, rollout or auto")
    needs_rollout = [key for key, on in (("actor.old_log_prob_source = 'rollout'", source == "rollout"),
                                         (f"algorithm.rollout_correction.mode = {corr.mode!r}", corr.mode != "none"))
                     if on]
    if needs_rollout and not rollout.calculate_log_probs:
        r.err(f"{' and '.join(needs_rollout)} needs the rollout engine's log-probs: set rollout.calculate_log_probs: true")
    if corr.mode == "icepop" and corr.level != "token":
        r.err(f"algorithm.rollout_correction.level = {corr.level!r}: icepop weighs single tokens; use level token "
              "(or mode mis for sequence-level masking)")
    loss_mode = actor.policy_loss.loss_mode
    if source == "rollout" and corr.mode in ("tis", "mis", "icepop") and loss_mode in RATIO_LOSSES:
        r.err(f"algorithm.rollout_correction.mode = {corr.mode!r} with actor.old_log_prob_source = 'rollout' and "
              f"actor.policy_loss.loss_mode = {loss_mode!r}: the ratio against the rollout log-probs already is the "
              "importance weight, the correction would apply it twice; use mode reject or none, a trainer source "
              "(recompute, update, auto), or loss_mode reinforce")
    r.positive("algorithm.rollout_correction.threshold")
    r.positive("algorithm.rollout_correction.lower")
    if corr.lower is not None and corr.upper is not None and corr.upper < corr.lower:
        r.err(f"algorithm.rollout_correction.upper = {corr.upper}: must be >= lower = {corr.lower}")
    r.positive("rollout.max_logprob_gap")
