"""Rules on how rows are generated and which log-probs the update compares them with: the asynchronous
modes and partial rollouts, multi-turn tool use, the chat template's extra arguments, the seeds the
rollout engines take, and the old-log-prob source with the rollout correction.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from megarl.config.chat_template import chat_template_kwargs_errors
from megarl.config.rules import Rules, as_dict, pool_size
from megarl.config.schema import TrainerConfig

ASYNC_MODES = ("sync", "one_step_off", "bounded_staleness")
PARTIAL_MODES = ("off", "continue", "drop")  # trainer.partial_rollout


def check_async(r: Any, cfg: Any, world: int) -> None:
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


# Built-in names of megarl.agent.tools.BUILTIN_TOOLS and megarl.agent.parsers (a test keeps them equal).
MULTI_TURN_TOOLS = {"calculator", "code_interpreter"}
MULTI_TURN_FORMATS = {"hermes"}
TRUNCATE_SIDES = ("left", "middle", "right")  # megarl.agent.loop.cut_tool_output's sides


def check_multi_turn(r: Any, multi_turn: Any) -> None:
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


def check_chat_template_kwargs(r: Rules, cfg: DictConfig) -> None:
    """data.apply_chat_template_kwargs: extra arguments of the chat template, read where it renders the
    prompts (data.apply_chat_template auto or true) and the tool turns (rollout.multi_turn.enable)."""
    kwargs = as_dict(cfg.data.apply_chat_template_kwargs)
    if not kwargs:
        return
    for message in chat_template_kwargs_errors(kwargs):
        r.err(message)
    if str(cfg.data.apply_chat_template).strip().lower() == "false" and not cfg.rollout.multi_turn.enable:
        r.err(f"data.apply_chat_template_kwargs = {kwargs!r} with data.apply_chat_template = "
              f"{cfg.data.apply_chat_template!r} and no multi-turn rollout: no chat template is applied, nothing "
              "reads them; set data.apply_chat_template auto or true (or rollout.multi_turn.enable), or remove them")


# Rollout engine r is seeded with trainer.seed x ROLLOUT_SEED_FACTOR + r (megarl.trainer.run_spec).
ROLLOUT_SEED_FACTOR = 1000


def check_seeds(r: Rules, cfg: DictConfig, world: int) -> None:
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
    `ppo_mini_batch_size` prompts (which divides it: `layout_rules._check_batches`)."""
    return int(role_cfg.ppo_epochs) * (int(cfg.data.train_batch_size) // int(role_cfg.ppo_mini_batch_size))


def update_is_on_policy(cfg: DictConfig) -> bool:
    """The policy cannot change between generation and the actor's update: one optimizer step, one PPO
    epoch of one mini-batch holding the whole batch (so the update's own log-probs are the old ones)."""
    return optimizer_steps_per_step(cfg, cfg.actor) == 1


def check_old_log_probs(r: Rules, cfg: DictConfig) -> None:
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
