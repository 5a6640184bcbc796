"""Rules on the parallel layouts: each role's Megatron layout (TP x PP x CP x DP, experts) against its
pool and the model's shapes, the batch sizes and dynamic-batch token budgets it splits, what a
mixture-of-experts model and `model.prompt_sharing: always` need of it, the rollout's tensor
parallelism against the weight sync's shards, and the longest sequence against the model's positions.
"""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig

from megarl.config.rules import (Rules, as_dict, cp_padded_length, critic_enabled, dir_hf_config, divisors,
                                 pool_size, ref_enabled, role_parallel)
from megarl.layout import VLLM_VOCAB_PADDING


def check_layouts(r: Rules, cfg: DictConfig, hf: Optional[dict], world: int) -> None:
    """Each role's layout against its pool of `world` (the actor's) or its own, with the batches and
    token budgets it splits; then the mixture-of-experts limits and model.prompt_sharing: always."""
    actor, data, rollout, n = cfg.actor, cfg.data, cfg.rollout, cfg.rollout.n
    dp = check_layout(r, "actor", actor.megatron, world, "resources.actor_pool", hf)
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
        critic_dp = check_layout(r, "critic", role_parallel(cfg, "critic"), critic_world, pool_key, critic_hf)
        if cfg.resources.critic_pool is None and cfg.critic.megatron is not None and as_dict(cfg.critic.megatron) != as_dict(actor.megatron):
            r.err("critic.megatron differs from actor.megatron, but the critic shares the actor's processes "
                  "(resources.critic_pool is null); set critic.megatron to null (the actor's layout) or give the critic its own pool")
        _check_batches(r, "critic", cfg.critic, data.train_batch_size, n, critic_dp)
        if critic_dp:
            _check_token_budget(r, "critic", cfg.critic, role_parallel(cfg, "critic"), seq_len)
        if cfg.critic.model_path:
            check_positions(r, critic_hf, "the critic's", f"critic.model_path: {cfg.critic.model_path}")
    moe_roles = [("actor", actor.megatron)] if is_moe(hf) else []
    if critic_enabled(cfg) and is_moe(critic_hf):
        moe_roles.append(("critic", role_parallel(cfg, "critic")))
    _check_moe(r, moe_roles)
    if cfg.model.prompt_sharing == "always":
        _check_prompt_sharing(r, cfg)
    if ref_enabled(cfg):
        ref_world = pool_size(cfg.resources.ref_pool) if cfg.resources.ref_pool is not None else world
        pool_key = "resources.ref_pool" if cfg.resources.ref_pool is not None else "resources.actor_pool"
        check_layout(r, "ref", role_parallel(cfg, "ref"), ref_world, pool_key, hf)
        if cfg.resources.ref_pool is None and cfg.ref.megatron is not None and as_dict(cfg.ref.megatron) != as_dict(actor.megatron):
            r.err("ref.megatron differs from actor.megatron, but the reference shares the actor's processes "
                  "(resources.ref_pool is null); set ref.megatron to null (the actor's layout) or give the reference its own pool")


def check_rollout_tp(r: Rules, cfg: DictConfig, hf: Optional[dict], world: int) -> None:
    """rollout.tensor_model_parallel_size against the actor's `world` devices and the model `hf`."""
    rollout = cfg.rollout
    rtp = rollout.tensor_model_parallel_size
    if rtp < 1 or world % rtp != 0:
        where = ("the rollout pool has as many ranks" if cfg.resources.rollout_pool is not None
                 else "the rollout shares the actor's devices")
        r.err(
            f"rollout.tensor_model_parallel_size = {rtp}: must divide the {world} devices of resources.actor_pool "
            f"({where}); valid: {divisors(world)}"
        )
    elif hf:
        heads = hf.get("num_attention_heads")
        if heads and heads % rtp != 0:
            r.err(f"rollout.tensor_model_parallel_size = {rtp}: must divide num_attention_heads = {heads}; valid: {divisors(heads)}")
        _check_rollout_tp_shards(r, hf, rtp)


def check_layout(r: Rules, role: str, par: Any, world: int, pool_key: str, hf: Optional[dict]) -> int:
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
            f"{world} devices of {pool_key} (nnodes x devices_per_node); valid products: {divisors(world)}"
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
                f"num_attention_heads = {heads}; valid: {divisors(heads)}"
            )
        if groups and groups % tp != 0:
            r.err(
                f"{role}.megatron.tensor_model_parallel_size = {tp}: must divide the model's query groups "
                f"(num_key_value_heads = {groups}); valid: {divisors(groups)}"
            )
        layers = hf.get("num_hidden_layers")
        if layers and layers % pp != 0:
            r.err(
                f"{role}.megatron.pipeline_model_parallel_size = {pp}: must divide num_hidden_layers = {layers}; "
                f"valid: {divisors(layers)}"
            )
        experts = hf.get("num_local_experts") or hf.get("num_experts")
        if ep > 1 and not experts:
            r.err(f"{role}.megatron.expert_model_parallel_size = {ep}: the model has no experts; use 1")
        elif experts and experts % ep != 0:
            r.err(f"{role}.megatron.expert_model_parallel_size = {ep}: must divide num_experts = {experts}; valid: {divisors(experts)}")
        if etp is not None and etp != tp:
            width = hf.get("moe_intermediate_size")
            if not experts:
                r.err(f"{role}.megatron.expert_tensor_parallel_size = {etp}: the model has no experts; leave it null")
            elif width and width % etp != 0:
                r.err(f"{role}.megatron.expert_tensor_parallel_size = {etp}: must divide the model's "
                      f"moe_intermediate_size = {width}; valid: {divisors(width)}")
    return dp


def is_moe(hf: Optional[dict]) -> bool:
    """Whether the HF config `hf` describes a mixture-of-experts model."""
    return bool(hf and (hf.get("num_local_experts") or hf.get("num_experts")))


def _check_moe(r: Rules, trained: list[tuple[str, Any]]) -> None:
    """What a mixture-of-experts model cannot do in `megarl train` yet (see README, Models), for the
    trained roles `(role, megatron layout)` whose model has experts."""
    for role, par in trained:
        if par.tensor_model_parallel_size > 1 and not par.sequence_parallel:
            r.err(f"{role}.megatron.tensor_model_parallel_size = {par.tensor_model_parallel_size}: training a "
                  f"mixture-of-experts model with TP > 1 needs {role}.megatron.sequence_parallel: true (Megatron "
                  "requires it), or use TP 1 and split the experts with expert_model_parallel_size")
    # An expert-parallel actor (EP > 1) is resharded into the rollout engine, and at rollout TP > 1
    # the experts land in vLLM's fused expert parameters (megarl.hybrid.sync).


def _check_prompt_sharing(r: Rules, cfg: DictConfig) -> None:
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


def _check_batches(r: Rules, role: str, sec: Any, train_bs: int, n: int, dp: int) -> None:
    mini = sec.ppo_mini_batch_size
    if mini < 1:
        r.err(f"{role}.ppo_mini_batch_size = {mini}: must be >= 1")
        return
    if train_bs % mini != 0:
        r.err(
            f"{role}.ppo_mini_batch_size = {mini} must divide data.train_batch_size = {train_bs} "
            f"(both count prompts); valid: {divisors(train_bs)}"
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
                f"gives each of the {dp} DP ranks; valid: {divisors(per_rank)}"
            )


def _check_token_budget(r: Rules, role: str, sec: Any, par: Any, seq_len: int, layout: str = "") -> None:
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


def check_positions(r: Rules, hf: Optional[dict], whose: str, source: str = "") -> None:
    """The longest sequence (prompt + response) within the positions of the model `hf` (`whose`, read
    from `source`)."""
    max_pos = (hf or {}).get("max_position_embeddings")
    data = r.cfg.data
    resp = r.cfg.rollout.response_length or data.max_response_length
    if max_pos and data.max_prompt_length + resp > max_pos:
        r.err(f"data.max_prompt_length + response length = {data.max_prompt_length} + {resp} exceeds {whose} "
              f"max_position_embeddings = {max_pos}{f' ({source})' if source else ''}")


def _check_rollout_tp_shards(r: Any, hf: dict, rtp: int) -> None:
    """The rest of what the weight sync's plan needs of the rollout's tensor parallelism
    (megarl.hybrid.slices): key/value heads split over the ranks or each replicated over a whole
    number of them, and the MLP's, the experts' and the padded vocabulary's rows split evenly."""
    if rtp <= 1:
        return
    key = f"rollout.tensor_model_parallel_size = {rtp}"
    kv_heads = hf.get("num_key_value_heads") or hf.get("num_attention_heads")
    if kv_heads and kv_heads % rtp != 0 and rtp % kv_heads != 0:
        r.err(f"{key}: must divide num_key_value_heads = {kv_heads} ({divisors(kv_heads)}) or be a "
              "multiple of it (each key/value head then replicated over the ranks)")
    for size_key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        size = hf.get(size_key)
        if size and size % rtp != 0:
            r.err(f"{key}: must divide {size_key} = {size}; valid: {divisors(size)}")
    vocab = hf.get("vocab_size")
    if vocab:
        padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        if padded % rtp != 0:
            r.err(f"{key}: must divide the vocabulary padded to a multiple of {VLLM_VOCAB_PADDING} "
                  f"({vocab} -> {padded}); valid: {divisors(padded)}")
