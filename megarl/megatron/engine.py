"""MegatronEngine: the model, optimizer and schedule that actor, critic, ref and reward workers wrap.
The frozen roles (ref, reward model: `EngineConfig.trained=False`) get the model alone: no DDP
gradient buffer, optimizer or schedule, forward passes only.

Every rank of the layout runs the same calls (SPMD). A batch given to a rank is that rank's DP
shard; all TP/PP/CP ranks of one DP replica must receive the same rows. Results are returned on every
rank (the last pipeline stage computes them and broadcasts them to the other stages).

Gradient convention (shared with `megarl.algorithms.aggregation`): `loss_fn` returns the
micro-batch's *share* of the mini-batch loss, normalised by the mini-batch's global counts and
multiplied by `dp_size`; micro-batch gradients are summed; DDP averages over DP. The engine undoes
Megatron's division of each micro-batch loss by the number of micro-batches, so the gradient is
exactly that of the whole mini-batch loss however the mini-batch is split. The same holds when
`train_step(skip_zero_advantage=True)` leaves out the rows whose advantages are all zero, for a loss
to which such rows add nothing: the normalisers count them, the schedule does not run them.

Context parallelism (cp > 1, `megarl.megatron.context_parallel`): each micro-batch's sequence axis is
padded to a multiple of 2*cp and split over the CP ranks (chunks r and 2*cp-1-r). Per-position
outputs are gathered back to full sequences before `loss_fn`, which therefore sees the same (b, R)
tensors on every CP rank and keeps the convention above (`dp_size` is the pure DP size). Megatron
multiplies each loss by cp and DDP averages over DP x CP ranks; the output gather's backward keeps
each rank's own slice, so the gradient equals that at cp=1. With `use_dynamic_bsz` the token
budget `max_token_len_per_micro_batch` is per rank: a micro-batch holds up to cp times as many tokens.

Sequence parallelism (`sequence_parallel`, tp > 1): Megatron splits each CP rank's share of the
sequence axis over the TP ranks outside the TP regions, so the axis is padded to a multiple of
2*cp*tp (tp at cp=1). All padding goes after the real tokens, where the causal mask hides it from
them, and per-position outputs are cut back to the real positions: padding never changes results.

Micro-batches: `micro_batch_size` rows in train_step, `log_prob_micro_batch_size` rows (0: the
same) in the forward-only calls; with `use_dynamic_bsz` the token budget decides both, and the DP
ranks of a MoE model run as many micro-batches each (`packing.plan_micro_batches_across`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer.module import Float16Module

from megarl.algorithms.aggregation import LossNormalisers, mini_batch_normalisers
from megarl.algorithms.policy_loss import rows_with_advantage_or_one
from megarl.errors import CheckpointError, ConfigError, DataError, EngineStateError
from megarl.layout import ParallelLayout
from megarl.megatron import checkpoint as ckpt
from megarl.megatron import offload as off
from megarl.megatron.attention import local_attention_supported
from megarl.megatron.context_parallel import SequenceShard, cp_alignment
from megarl.megatron.host_reduce import install_host_grad_reduce
from megarl.megatron.logprobs import vocab_parallel_logprobs_entropy
from megarl.megatron.model import build_model_chunk, load_megatron_state, unwrap, wrap_for_training
from megarl.megatron.optim import EngineConfig, build_optimizer, build_scheduler
from megarl.megatron.packing import (
    CompactRows,
    compact_rows,
    gather_response,
    pack_rows,
    packed_seq_ids,
    plan_micro_batches,
    plan_micro_batches_across,
    response_index,
    unpack,
)
from megarl.megatron.parallel import current_ranks
from megarl.megatron.shared_prompts import SharedPromptRows, prompt_groups, share_prompts, sharing_pays
from megarl.models.spec import ModelSpec, te_available
from megarl.models.weight_map import hf_to_megatron_state_dict, read_hf_tensors, stage_entries

LossFn = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], LossNormalisers], tuple[torch.Tensor, dict[str, Any]]]
OPTIONAL_HF_WEIGHTS = ("score.weight",)  # a critic initialised from a policy checkpoint has no head


def batch_tensors(batch: Any) -> dict[str, torch.Tensor]:
    """Tensor columns of a `megarl.protocol.Batch` or of a plain mapping."""
    if hasattr(batch, "tensor_keys"):
        return {k: batch[k] for k in batch.tensor_keys}
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    raise DataError(f"expected a Batch or a dict of tensors, got {type(batch).__name__}")


def rows_to_run(data: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B,) bool: the rows of a mini-batch whose `advantages` are nonzero on some response token. At
    least one row runs (the one with the fewest tokens): every rank runs the step's schedule, whose
    end reduces the gradients across the data-parallel ranks; a row of zero advantage adds nothing
    to the gradient there."""
    _require(data, ("advantages", "response_mask", "attention_mask"), "train_step(skip_zero_advantage=True)")
    return rows_with_advantage_or_one(data["advantages"], data["response_mask"], data["attention_mask"].sum(dim=-1))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _require(data: Mapping[str, torch.Tensor], keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise DataError(f"{what}: batch lacks columns {missing}; it has {sorted(data)}")


# Packing on a GPU without TransformerEngine: the local spec attends over one dense block-diagonal
# mask across the whole packed row (THD needs TE), so its cost grows with the square of the
# micro-batch's tokens. On an H200 at 32 sequences of 512 tokens (bf16, Qwen2.5-0.5B shape) the
# packed train step ran 0.44x and the log-prob pass 0.66x the padded one
# (benchmarks/results/gpu_h200/gpu_call4.json).
PACKING_WITHOUT_TE = (
    "model.use_remove_padding packs micro-batches, but TransformerEngine is not installed: packed rows "
    "attend over one dense block-diagonal mask, slower on a GPU than padded micro-batches (0.44x the "
    "padded train step on an H200 at 32 x 512 tokens). Install transformer-engine (THD attention) or set "
    "model.use_remove_padding: false.")


class FrozenEngineError(EngineStateError, AttributeError):
    """A training-only part (optimizer, schedule) of a frozen engine was used."""


class FrozenEngineState:
    """The optimizer or LR scheduler of a frozen engine (`EngineConfig.trained=False`), which has
    none: any use of it raises `EngineStateError` naming the role, except `reload_model_params`
    (called after a weight load), which has nothing to refresh. The error is also an
    AttributeError, so that `getattr(x, name, default)` and `hasattr` see no such attribute."""

    def __init__(self, role: str, what: str) -> None:
        self._role, self._what = role, what

    def reload_model_params(self) -> None:
        """No fp32 main parameters to refresh from the model's: the model's are the only copy."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise FrozenEngineError(f"{self._role} engine is frozen (EngineConfig.trained=False, a reference or reward "
                                f"model): it has no {self._what} (asked for its {name!r}); build the engine with "
                                f"trained=True to train or checkpoint it")

    def __repr__(self) -> str:
        return f"FrozenEngineState({self._role!r}, no {self._what})"


class MegatronEngine:
    """One rank's share of a Megatron model: trained (policy or value role, with DDP, optimizer and
    LR schedule) or frozen (`EngineConfig.trained=False`: reference policy, reward model; the model
    alone, for forward passes)."""

    def __init__(self, spec: ModelSpec, layout: ParallelLayout, engine_config: EngineConfig,
                 use_te: bool | None = None) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        self.cfg = engine_config
        self.spec = spec
        self.layout = layout
        self.ranks = current_ranks()
        self.role = self.cfg.role
        self.use_te = te_available() if use_te is None else use_te
        if self.cfg.sequence_parallel and self.ranks.tp_size == 1:
            raise ConfigError("engine config: sequence_parallel=True needs tensor parallel size > 1 "
                              "(it splits the sequence over the TP ranks); this layout has tp=1")
        # The sequence axis of every micro-batch is padded to a multiple of this (see module doc).
        sp_split = self.ranks.tp_size if self.cfg.sequence_parallel else 1
        self.seq_multiple = cp_alignment(self.ranks.cp_size) * sp_split
        torch.manual_seed(self.cfg.seed)
        model_parallel_cuda_manual_seed(self.cfg.seed)
        self.model = build_model_chunk(spec, self.role, self.cfg.torch_dtype, self.ranks.tp_size,
                                       self.ranks.pp_size, self.use_te, cp=self.ranks.cp_size,
                                       ep=self.ranks.ep_size, sequence_parallel=self.cfg.sequence_parallel,
                                       recompute_granularity=self.cfg.recompute_granularity,
                                       etp=self.ranks.etp_size)
        self.trained = self.cfg.trained
        self.ddp: torch.nn.Module  # what the schedule runs; `unwrap(self.ddp)` is the GPTModel
        self.optimizer: Any
        self.scheduler: Any
        if self.trained:
            self.ddp = wrap_for_training(self.model, self.cfg.use_distributed_optimizer)
            # Bucket groups whose data-parallel sum runs through shared memory (0: gloo's all-reduce).
            self.host_reduced_buckets = install_host_grad_reduce(self.ddp) if self.cfg.host_grad_reduce else 0
            self.optimizer = build_optimizer(self.cfg, [self.ddp])
            self.scheduler = build_scheduler(self.cfg, self.optimizer)
            config = self.model.config
            config.finalize_model_grads_func = finalize_model_grads
            config.no_sync_func = self.ddp.no_sync
            config.grad_scale_func = self.optimizer.scale_loss
        else:
            # A frozen role (reference policy, reward model): forward passes only. No DDP wrapper
            # (its gradient buffer is 2x the bf16 weights), no optimizer (its fp32 main copy another
            # 2x), no schedule: the parameters are all the engine holds on the device.
            self.ddp = self._frozen_model()
            self.host_reduced_buckets = 0
            self.optimizer = FrozenEngineState(self.role, "optimizer")
            self.scheduler = FrozenEngineState(self.role, "LR scheduler")
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.cp_group = ps.get_context_parallel_group()
        self.is_last_stage = ps.is_pipeline_last_stage()
        # The policy's output layer computes the logits of the positions that predict a response
        # token only (`_head_positions`, set per micro-batch): the prompt positions' logits and
        # their fp32 softmax over the vocabulary are never used. Under sequence parallelism (the
        # output layer gathers the sequence itself) every position's logits are computed and the
        # response positions selected before the softmax; at cp > 1 (positions split over ranks)
        # every local position goes through the softmax (`_head_outputs`).
        self.selects_head_positions = (self.role == "policy" and self.is_last_stage and self.ranks.cp_size == 1
                                       and not self.cfg.sequence_parallel)
        self._head_positions: tuple[torch.Tensor, ...] | None = None
        if self.selects_head_positions:
            self.model.output_layer.register_forward_pre_hook(self._select_head_positions)
        self.last_stage_rank = ps.get_pipeline_model_parallel_last_rank()
        # Rows with the same prompt computed as one sequence (`shared_prompts`; cfg.prompt_sharing).
        self.prompt_sharing = self._prompt_sharing_mode()
        self._rope_positions: torch.Tensor | None = None
        if self.prompt_sharing != "never":
            layer = self.model.decoder.layers[0]
            self._layer_params = sum(p.numel() for p in layer.parameters())
            self._attention_width = self.model.config.kv_channels * (self.model.config.num_attention_heads
                                                                     // self.ranks.tp_size)
        # Micro-batches whose rows do not each start at column 0 (shared prompts; packed rows on the
        # local spec) take their rotary embedding at each token's own position (`_rope_at_positions`).
        # TransformerEngine's packed (THD) layout restarts the positions of each row itself.
        self.rope_at_row_positions = self.prompt_sharing != "never" or (self.cfg.use_sequence_packing
                                                                        and not self.use_te)
        if self.rope_at_row_positions:
            self.model.rotary_pos_emb.register_forward_hook(self._rope_at_positions)
        self.padded_vocab = spec.padded_vocab_size(self.ranks.tp_size)
        self.vocab_start = self.ranks.tp_rank * (self.padded_vocab // self.ranks.tp_size)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if self.cfg.use_sequence_packing and self.device.type == "cuda" and not self.use_te and self.ranks.rank == 0:
            warnings.warn(PACKING_WITHOUT_TE, stacklevel=2)
        self.offloaded: off.OffloadState | None = None
        self.hf_dir: str | None = None  # the HF directory the weights came from (load_hf_weights)

    def _frozen_model(self) -> torch.nn.Module:
        """The model of a frozen engine, ready for forward passes: no parameter needs a gradient, and
        in bf16 it is wrapped in Float16Module as `wrap_for_training` wraps a trained one (fp32
        outputs on the last stage), so its log-probs are those of a trained engine with the same
        weights, bit for bit."""
        for p in self.model.parameters():
            p.requires_grad_(False)
        config = self.model.config
        model: torch.nn.Module = Float16Module(config, self.model) if config.bf16 or config.fp16 else self.model
        return model.eval()

    def _check_trained(self, call: str) -> None:
        if not self.trained:
            raise FrozenEngineError(f"{self.role} engine: {call} on a frozen engine (EngineConfig.trained=False, "
                                    f"a reference or reward model): it has no optimizer, gradient buffer or LR "
                                    f"schedule; build the engine with trained=True to train it")

    # ------------------------------------------------------------------ weights
    def load_hf_weights(self, hf_dir: str) -> None:
        """Load this rank's shard from HF safetensors via the spec's weight map. The directory is
        remembered (`hf_dir`): checkpoints record it, so that an export finds this model's config
        and tokenizer files."""
        self.hf_dir = str(Path(hf_dir).absolute())
        spec = self._role_spec()
        names = {h for _, _, hf in stage_entries(spec, self.ranks.pp_rank, self.ranks.pp_size, self.use_te,
                                  self.ranks.ep_rank, self.ranks.ep_size) for h in hf}
        # A reward model's score head is its output: never optional.
        optional = {n for n in names if n in OPTIONAL_HF_WEIGHTS} if self.role == "value" else set()
        hf_sd = read_hf_tensors(hf_dir, names - optional)
        try:
            hf_sd.update(read_hf_tensors(hf_dir, optional))
        except CheckpointError:
            pass  # no head in the checkpoint (a critic started from a policy): keep the seeded init
        self.load_hf_state_dict(hf_sd)

    def load_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor]) -> None:
        """Load from an in-memory HF state dict (all tensors, or at least this rank's)."""
        spec = self._role_spec()
        present = dict(hf_sd)
        optional = tuple(
            name for e, name, hf in stage_entries(spec, self.ranks.pp_rank, self.ranks.pp_size, self.use_te,
                                  self.ranks.ep_rank, self.ranks.ep_size)
            if self.role == "value" and any(h in OPTIONAL_HF_WEIGHTS and h not in present for h in hf)
        )
        skip_entries = set(optional)
        state = hf_to_megatron_state_dict(
            present, spec, self.ranks.tp_rank, self.ranks.tp_size, self.ranks.pp_rank,
            self.ranks.pp_size, skip=skip_entries, te_names=self.use_te,
            ep_rank=self.ranks.ep_rank, ep_size=self.ranks.ep_size,
            etp_rank=self.ranks.etp_rank, etp_size=self.ranks.etp_size,
        )
        load_megatron_state(self.ddp, state, self.role, optional=optional)
        self.optimizer.reload_model_params()  # a frozen engine's: nothing to refresh

    def _prompt_sharing_mode(self) -> str:
        """cfg.prompt_sharing where this engine can share prompts, "auto" off a GPU only; "never"
        elsewhere ("always" where it cannot is an error)."""
        if self.role == "reward":  # its score is read at each row's last token: rows stay whole
            return "never"
        mode = self.cfg.prompt_sharing
        own_attention = None if self.use_te else local_attention_supported(self.model.config)
        blockers = [why for why, present in (
            ("TransformerEngine's attention takes no explicit mask", self.use_te),
            (f"context parallelism (cp={self.ranks.cp_size})", self.ranks.cp_size > 1),
            (f"pipeline parallelism (pp={self.ranks.pp_size})", self.ranks.pp_size > 1),
            ("sequence parallelism", self.cfg.sequence_parallel),
            (f"Megatron's own attention for {own_attention}", own_attention is not None),
        ) if present]
        if blockers and mode == "always":
            raise ConfigError(f"engine config: prompt_sharing='always' is not implemented with {blockers[0]}; "
                              "use 'auto' (shares where it can) or 'never'")
        if mode == "auto" and torch.cuda.is_available():
            # Measured slower on a GPU: on one H200 (0.5B, bf16, 4 prompts x 8 responses, 512 + 128
            # tokens) the masked shared sequence ran the log-prob pass at 0.90x and the update at
            # 0.84x the padded micro-batches, with 3.3x fewer tokens. "always" still shares there.
            return "never"
        return "never" if blockers else mode

    def _role_spec(self) -> ModelSpec:
        return self.spec.for_role(self.role)

    def get_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Megatron name, this rank's local shard) for every parameter of this stage.
        Decoder layer indices are stage-local and names follow the layer spec in use (`self.use_te`),
        as in `megarl.models.weight_map.stage_entries(..., te_names=self.use_te)`."""
        for name, p in unwrap(self.ddp).named_parameters():
            yield name, p.detach()

    # ------------------------------------------------------------------ schedule
    def _micro_batches(self, data: dict[str, torch.Tensor], forward_only: bool = False) -> list[dict[str, Any]]:
        _require(data, ("input_ids", "attention_mask", "responses"), "engine")
        response_len = int(data["responses"].shape[1])
        rows = compact_rows(data["input_ids"], data["attention_mask"], response_len)
        if self.spec.attention_window is not None and int(rows.total_lens.max()) > self.spec.attention_window:
            raise DataError(
                f"{self.spec.family}: a sequence of {int(rows.total_lens.max())} tokens exceeds the "
                f"sliding attention window {self.spec.attention_window}, which this engine does not implement"
            )
        packing = self.cfg.use_sequence_packing
        if self.cfg.use_dynamic_bsz:
            # The token budget is per rank: at cp > 1 a micro-batch holds up to cp times as many.
            plan = dict(max_tokens=self.cfg.max_token_len_per_micro_batch, packed=packing,
                        cp=self.ranks.cp_size, pad_each=self.use_te)
            if self.ranks.dp_size > 1 and self.spec.num_experts:
                # Every DP rank of a MoE model runs the same number of micro-batches: the expert
                # (and expert-tensor) parallel groups can span DP ranks (EP > 1 at TP = 1), and
                # their token dispatch is a collective in every micro-batch, which a rank with
                # fewer micro-batches would leave the others waiting in. A dense model has no
                # collective across DP ranks inside the schedule (DDP reduces once per step): each
                # rank keeps its own, fewest, micro-batches.
                who = f"{self.role} engine, data-parallel rank {self.ranks.dp_rank} of {self.ranks.dp_size}"
                plans = plan_micro_batches_across(rows.total_lens, self.dp_group, self.device, who, **plan)
            else:
                plans = plan_micro_batches(rows.total_lens, **plan)
        else:
            size = self.cfg.forward_micro_batch_size if forward_only else self.cfg.micro_batch_size
            plans = plan_micro_batches(rows.total_lens, micro_batch_size=size)
        micro = []
        for idx in plans:
            width = int(rows.total_lens[idx].max())
            sub = CompactRows(rows.tokens[idx, :width], rows.prompt_lens[idx], rows.total_lens[idx],
                              response_len).to(self.device)
            mb = {"index": idx, "rows": sub, "data": {k: v[idx].to(self.device) for k, v in data.items()}}
            shared = self._shared_layout(sub)
            if shared is not None:
                mb.update(shared=shared, tokens=shared.tokens, positions=shared.positions,
                          attention_mask=shared.mask)
            else:
                mb.update(self._packed_inputs(sub) if packing else self._padded_inputs(sub))
            if self.selects_head_positions:
                mb["head_positions"] = self._response_positions(mb, response_index(sub)[0], seq_first=True)
            micro.append(mb)
        return micro

    def _shared_layout(self, rows: CompactRows) -> SharedPromptRows | None:
        """The micro-batch as one sequence per prompt (`shared_prompts`), when cfg.prompt_sharing asks
        for it here; None keeps the padded or packed layout."""
        if self.prompt_sharing == "never" or rows.response_len == 0:
            return None
        groups = prompt_groups(rows)
        if len(groups) == len(rows.prompt_lens):
            return None
        if self.prompt_sharing == "auto" and not sharing_pays(rows, groups, self._layer_params, self._attention_width):
            return None
        return share_prompts(rows, groups)

    def _rope_at_positions(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook of the rotary embedding. Megatron computes it for the columns 0..S-1 of the
        micro-batch (at cp > 1 this rank's share of them) and ignores the position ids it is given.
        Shared-prompt and packed micro-batches (`self._rope_positions` set) get each token's own
        position in its row instead, (S, G, 1, dim) for positions (G, S): with relative positions
        equal, attention is the same in exact arithmetic, but in float32 the rotation angle of a
        token at column p carries an error of about p * 2**-24 rad, so a row packed at column 7,620
        had log-probs 58x as far from float64 math as the same row alone (2.5e-5 against 4.4e-7)."""
        if self._rope_positions is None:
            return None
        positions = self._rope_positions
        # The table of positions 0..max, not split over context-parallel ranks (the positions are
        # this rank's tokens' own).
        table = module.get_emb(int(positions.max()) + 1)
        return table[:, 0][positions.t()]

    def _padded_inputs(self, rows: CompactRows) -> dict[str, Any]:
        """Model inputs of a padded micro-batch (b, T), T padded to a multiple of `seq_multiple`;
        at cp > 1 this CP rank's share of it. "targets" (the next token of each position) are taken
        before the split."""
        tokens = rows.tokens
        b, width = tokens.shape
        cp = self.ranks.cp_size
        full = torch.nn.functional.pad(tokens, (0, _round_up(width, self.seq_multiple) - width))
        if cp == 1:
            positions = torch.arange(full.shape[1], device=self.device).unsqueeze(0).expand(b, -1)
            return {"tokens": full, "positions": positions, "targets": torch.roll(full, -1, dims=1)}
        shard = SequenceShard.contiguous(full.shape[1], cp, self.ranks.cp_rank, self.device)
        return {"tokens": shard.local(full), "positions": shard.index.unsqueeze(0).expand(b, -1),
                "targets": shard.local(torch.roll(full, -1, dims=1)), "cp_shard": shard}

    def _packed_inputs(self, rows: CompactRows) -> dict[str, Any]:
        """Model inputs of a micro-batch packed into one row (1, S).

        Local spec: a block-diagonal causal mask; the packed row is padded at its end to a multiple
        of `seq_multiple`; at cp > 1 it is split as a whole, and the mask has this rank's query rows
        against all gathered key columns (gathered order, see `attention.LocalAttention`).
        TransformerEngine: THD with cu_seqlens; when `seq_multiple` > 1 each row is padded to a
        multiple of it on its own (at cp > 1 split on its own), the layout TE's THD context
        parallelism and Megatron's THD RoPE expect (GPU only, not run on CPU).
        """
        cp, rank = self.ranks.cp_size, self.ranks.cp_rank
        te_cp = self.use_te and cp > 1
        per_row_align = self.use_te and self.seq_multiple > 1
        packed = pack_rows(rows, with_mask=False, align=self.seq_multiple if per_row_align else 1)
        tokens = packed.tokens
        width = _round_up(tokens.shape[1], self.seq_multiple)
        tokens = torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]))
        seq_ids = packed_seq_ids(packed, width)
        positions = (torch.arange(width, device=self.device) - packed.offsets[seq_ids.clamp(min=0)]).unsqueeze(0)
        positions = torch.where(seq_ids >= 0, positions, torch.zeros_like(positions))
        targets = torch.roll(tokens, -1, dims=1)
        out: dict[str, Any] = {"packed": packed, "tokens": tokens, "positions": positions, "targets": targets,
                               "attention_mask": None}
        shard = None
        if cp > 1:
            if te_cp:
                shard = SequenceShard.per_sequence(packed.padded_lengths, cp, rank)
            else:
                shard = SequenceShard.contiguous(width, cp, rank, self.device)
        if not self.use_te:
            q = shard.index if shard is not None else torch.arange(width, device=self.device)
            k = shard.gathered if shard is not None else q
            visible = (seq_ids[q].unsqueeze(1) == seq_ids[k].unsqueeze(0)) & (k.unsqueeze(0) <= q.unsqueeze(1))
            out["attention_mask"] = (~visible).unsqueeze(0).unsqueeze(0)
        if shard is not None:
            out.update(tokens=shard.local(tokens), positions=shard.local(positions), targets=shard.local(targets),
                       cp_shard=shard)
        if self.use_te:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = packed.cu_seqlens
            longest = int(packed.padded_lengths.max())
            out["packed_seq_params"] = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                cu_seqlens_q_padded=cu if te_cp else None, cu_seqlens_kv_padded=cu if te_cp else None)
        return out

    def _select_head_positions(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook of the output layer: hidden states (s, b, h) -> the current micro-batch's
        response-predicting positions, (R, b, h) padded or (b*R, 1, h) packed."""
        if self._head_positions is None:
            return None
        return (args[0][self._head_positions], *args[1:])

    def _run(self, micro: list[dict[str, Any]], loss_func: Callable[..., Any], forward_only: bool) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module) -> Any:
            mb = next(data_iterator)
            self._head_positions = mb.get("head_positions")
            self._rope_positions = mb["positions"] if self.rope_at_row_positions and (
                "shared" in mb or "packed" in mb) else None
            output = model(mb["tokens"], mb["positions"], mb.get("attention_mask"),
                           packed_seq_params=mb.get("packed_seq_params"))
            return output, functools.partial(loss_func, mb)

        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro),
                model=[self.ddp],
                num_microbatches=len(micro),
                # Global length: Megatron divides it by the CP size for the pipeline's tensor shapes.
                seq_length=max(int(m["tokens"].shape[1]) for m in micro) * self.ranks.cp_size,
                micro_batch_size=max(int(m["tokens"].shape[0]) for m in micro),
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        finally:
            # The last micro-batch's index tensors (device memory) are not kept past the call.
            self._head_positions = self._rope_positions = None

    @staticmethod
    def _response_positions(mb: dict[str, Any], index: torch.Tensor, seq_first: bool = False
                            ) -> tuple[torch.Tensor, ...]:
        """Index of the positions whose outputs predict the response tokens in a tensor of the
        micro-batch (cp = 1), from `response_index(mb["rows"])`'s index: of a (b, s, ...) tensor it
        takes (b, R, ...); with `seq_first`, of a (s, b, ...) tensor it takes (R, b, ...) for padded
        rows and (b*R, 1, ...) for the packed row. Response padding points at some valid position;
        callers mask it."""
        if "shared" in mb:  # (group, position) of each response token, from `share_prompts`
            group, position = mb["shared"].head
            return (position.t(), group.t()) if seq_first else (group, position)
        if "packed" in mb:
            flat = (mb["packed"].offsets.unsqueeze(1) + index).clamp(max=mb["tokens"].shape[1] - 1)
            return (flat.reshape(-1),) if seq_first else (0, flat)
        at = torch.arange(index.shape[0], device=index.device)
        return (index.t(), at.unsqueeze(0)) if seq_first else (at.unsqueeze(1), index)

    def _head_outputs(self, mb: dict[str, Any], output: torch.Tensor, temperature: float,
                      with_entropy: bool) -> dict[str, torch.Tensor]:
        """Model output (b, s, V_local) or (b, s, 1) -> response-aligned (b, R) tensors.
        At cp > 1, s is this CP rank's share: per-position results are gathered over the CP group
        into global order first (differentiably; see `context_parallel.SequenceShard.gather`)."""
        rows: CompactRows = mb["rows"]
        shard: SequenceShard | None = mb.get("cp_shard")

        def per_row(x: torch.Tensor) -> torch.Tensor:  # this rank's (b, s) -> (b, T) per row
            if shard is not None:
                x = shard.gather(x, self.cp_group)
            if "packed" in mb:
                return unpack(x, mb["packed"], rows.tokens.shape[1])
            return x[:, :rows.tokens.shape[1]]

        if self.role != "policy" and "shared" in mb:  # the value role (no reward role shares prompts)
            index, valid = response_index(rows)
            values = output[..., 0].float()[self._response_positions(mb, index)]
            return {"values": torch.where(valid, values, torch.zeros_like(values))}
        if self.role != "policy":
            values = per_row(output[..., 0].float())
            return {"values": gather_response(values, rows), "per_position": values}
        if shard is None:  # only the positions that predict a response token (b, R)
            index, valid = response_index(rows)
            positions = self._response_positions(mb, index)
            if "head_positions" in mb:  # the output layer computed only those: (b, R, V) or (1, b*R, V)
                logits = output.reshape(*positions[-1].shape, output.shape[-1])
            else:
                logits = output[positions]
            targets = mb["shared"].targets if "shared" in mb else mb["targets"][positions]
            lp, ent = vocab_parallel_logprobs_entropy(
                logits, targets, self.vocab_start, self.spec.vocab_size, temperature, self.tp_group, with_entropy)
            out = {"log_probs": torch.where(valid, lp, torch.zeros_like(lp))}
            if ent is not None:
                out["entropys"] = torch.where(valid, ent, torch.zeros_like(ent))
            return out
        # At cp > 1 every local position, gathered into row order. The next token is the target;
        # at a packed row's end it belongs to the next row, a position gather_response never reads.
        lp, ent = vocab_parallel_logprobs_entropy(
            output, mb["targets"], self.vocab_start, self.spec.vocab_size, temperature, self.tp_group, with_entropy
        )
        out = {"log_probs": gather_response(per_row(lp), rows)}
        if ent is not None:
            out["entropys"] = gather_response(per_row(ent), rows)
        return out

    def _check_onloaded(self, call: str, needs: tuple[str, ...] = off.GROUPS) -> None:
        if self.offloaded is not None and self.offloaded.groups & set(needs):
            raise RuntimeError(f"{call} called while the engine is offloaded to CPU: call onload() first")

    def _forward_collect(self, batch: Any, temperature: float, with_entropy: bool) -> tuple[list[dict[str, Any]], list[Any]]:
        self._check_onloaded("forward", needs=("params",))
        data = batch_tensors(batch)
        micro = self._micro_batches(data, forward_only=True)

        def collect(mb: dict[str, Any], output: torch.Tensor, non_loss_data: bool = True) -> dict[str, Any]:
            out = self._head_outputs(mb, output, temperature, with_entropy)
            if self.role == "reward":
                last = (mb["rows"].total_lens - 1).clamp(min=0)
                out["scores"] = out["per_position"].gather(1, last.unsqueeze(1)).squeeze(1)
            out.pop("per_position", None)
            return out

        self.ddp.eval()
        with torch.no_grad():
            results = self._run(micro, collect, forward_only=True)
        if self.trained:
            self.ddp.train()
        return micro, results

    def _assemble(self, micro: list[dict[str, Any]], results: list[Any], key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Scatter per-micro-batch results back to batch order; broadcast from the last stage."""
        out = torch.zeros(shape, dtype=torch.float32)
        if self.is_last_stage:
            for mb, res in zip(micro, results):
                out[mb["index"]] = res[key].float().cpu()
        if self.ranks.pp_size > 1:
            buf = out.to(self.device)
            dist.broadcast(buf, src=self.last_stage_rank, group=self.pp_group)
            out = buf.cpu()
        return out

    # ------------------------------------------------------------------ inference calls
    def compute_log_prob(self, batch: Any, temperature: float = 1.0, calculate_entropy: bool = False) -> dict[str, torch.Tensor]:
        """{"log_probs": (B, R), "entropys": (B, R) if asked}, float32, 0 on response padding.
        Log-prob of response token t is taken from the logits at position P+t-1 divided by
        `temperature`."""
        self._check_role("compute_log_prob", "policy")
        micro, results = self._forward_collect(batch, temperature, calculate_entropy)
        b, r = batch_tensors(batch)["responses"].shape
        out = {"log_probs": self._assemble(micro, results, "log_probs", (b, r))}
        if calculate_entropy:
            out["entropys"] = self._assemble(micro, results, "entropys", (b, r))
        return out

    def compute_values(self, batch: Any) -> torch.Tensor:
        """(B, R) values: V at the state before response token t (position P+t-1)."""
        self._check_role("compute_values", "value", "reward")
        micro, results = self._forward_collect(batch, 1.0, False)
        b, r = batch_tensors(batch)["responses"].shape
        return self._assemble(micro, results, "values", (b, r))

    def compute_rm_score(self, batch: Any) -> torch.Tensor:
        """(B,) reward-model scores at each sequence's last valid token."""
        self._check_role("compute_rm_score", "reward")
        micro, results = self._forward_collect(batch, 1.0, False)
        return self._assemble(micro, results, "scores", (len(batch_tensors(batch)["responses"]),))

    def _check_role(self, call: str, *allowed: str) -> None:
        if self.role not in allowed:
            raise DataError(f"{call} needs an engine of role {allowed}, this engine's role is {self.role!r}")
        self._check_resident(call, needs=("params",))

    def _check_resident(self, call: str, needs: tuple[str, ...] = off.GROUPS) -> None:
        """A forward pass needs the parameters on the device; an optimizer step needs everything."""
        missing = self.offloaded.groups & set(needs) if self.offloaded is not None else set()
        if missing:
            raise EngineStateError(f"{self.role} engine: {call} while its {', '.join(sorted(missing))} are "
                                   f"offloaded to host memory ({self.offloaded.num_bytes / 2**20:.1f} MiB); "
                                   f"onload() first")

    # ------------------------------------------------------------------ training
    def train_step(self, batch: Any, loss_fn: LossFn, mini_batch_size: int, epochs: int = 1,
                   shuffle: bool = False, temperature: float = 1.0, calculate_entropy: bool = False,
                   max_response_len: int | None = None, skip_zero_advantage: bool = False) -> dict[str, Any]:
        """Optimizer steps over mini-batches of this rank's rows (`mini_batch_size` rows per DP rank).

        `loss_fn(outputs, micro_batch, normalisers) -> (loss, metrics)`; outputs hold "log_probs"
        (and "entropys") for a policy or "values" for a critic, (b, R), differentiable. Returns
        metrics as lists, one value per optimizer step: loss, grad_norm, lr, and loss_fn's metrics
        (mean over micro-batches).

        `skip_zero_advantage`: each mini-batch's rows whose `advantages` are zero on every response
        token are counted in the normalisers but not run (only for a `loss_fn` to which they add
        nothing); metrics `zero_advantage_rows_skipped` and `zero_advantage_tokens_skipped`, the share
        of the mini-batch's rows and of its tokens (prompt + response) left out, over every DP rank.
        """
        self._check_trained("train_step")
        self._check_resident("train_step")
        data = batch_tensors(batch)
        _require(data, ("response_mask",), "train_step")
        n = len(data["responses"])
        gen = torch.Generator().manual_seed(self.cfg.seed + int(self.scheduler.num_steps))
        history: dict[str, list[float]] = {}
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
            for start in range(0, n, mini_batch_size):
                idx = order[start:start + mini_batch_size]
                step = self._optimizer_step({k: v[idx] for k, v in data.items()}, loss_fn, temperature,
                                            calculate_entropy, max_response_len, skip_zero_advantage)
                for k, v in step.items():
                    history.setdefault(k, []).append(v)
        return history

    def _normalisers(self, mask: torch.Tensor, max_response_len: int | None, extra: Sequence[float] = ()
                     ) -> tuple[LossNormalisers, list[float]]:
        """This rank's counts, summed over the DP ranks that share the mini-batch; `extra` counts of
        this rank summed with them (in the same all-reduce)."""
        local = mini_batch_normalisers(mask, max_response_len=max_response_len, dp_size=self.ranks.dp_size)
        counts = torch.tensor([local.global_num_tokens, local.global_num_seqs, *extra], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(counts, group=self.dp_group)
        totals = counts.tolist()
        return dataclasses.replace(local, global_num_tokens=totals[0], global_num_seqs=totals[1]), totals[2:]

    def _rows_with_advantage(self, data: dict[str, torch.Tensor], max_response_len: int | None
                             ) -> tuple[dict[str, torch.Tensor], LossNormalisers, dict[str, float]]:
        """The mini-batch's rows that run (`rows_to_run`), the normalisers of all its rows, and the
        shares of its rows and tokens (prompt + response) left out, over every DP rank."""
        keep = rows_to_run(data)
        tokens = data["attention_mask"].sum(dim=-1)
        counts = [len(keep), float(keep.sum()), float(tokens.sum()), float(tokens[keep].sum())]
        normalisers, (rows, rows_run, all_tokens, tokens_run) = self._normalisers(
            data["response_mask"], max_response_len, counts)
        skipped = {"zero_advantage_rows_skipped": 1.0 - rows_run / rows,
                   "zero_advantage_tokens_skipped": 1.0 - tokens_run / max(all_tokens, 1.0)}
        if not bool(keep.all()):
            index = keep.nonzero().squeeze(-1)
            data = {k: v[index] for k, v in data.items()}
        return data, normalisers, skipped

    def _optimizer_step(self, data: dict[str, torch.Tensor], loss_fn: LossFn, temperature: float,
                        with_entropy: bool, max_response_len: int | None,
                        skip_zero_advantage: bool = False) -> dict[str, float]:
        self._check_trained("train_step")
        self._check_onloaded("train_step")
        if skip_zero_advantage:
            data, normalisers, skipped = self._rows_with_advantage(data, max_response_len)
        else:
            (normalisers, _), skipped = self._normalisers(data["response_mask"], max_response_len), {}
        micro = self._micro_batches(data)
        num_micro = len(micro)

        def train_loss(mb: dict[str, Any], output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            outputs = self._head_outputs(mb, output, temperature, with_entropy)
            outputs.pop("per_position", None)
            loss, metrics = loss_fn(outputs, mb["data"], normalisers)
            # Rows per sequence the model ran (1: every row alone; > 1: rows shared their prompt).
            # Only a shared-prompt micro-batch has a sequence of several rows: a packed one's single
            # (1, S) row still computes every row on its own.
            shared = len(mb["index"]) / mb["tokens"].shape[0] if "shared" in mb else 1.0
            # Megatron divides each micro-batch loss by the number of micro-batches: undo it.
            report = {"loss_share": loss.detach().float(), "rows_per_sequence": torch.tensor(shared)}
            report.update({k: torch.as_tensor(v).detach().float() for k, v in metrics.items()})
            return loss * num_micro, report

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = self._run(micro, train_loss, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.scheduler.step(increment=1)
        return {**self._reduce_metrics(results, grad_norm, lr), **skipped}

    def _reduce_metrics(self, results: list[dict[str, torch.Tensor]], grad_norm: Any, lr: float) -> dict[str, float]:
        keys = sorted(results[0]) if results else []
        payload = {"loss": sum(float(r["loss_share"]) for r in results)} if self.is_last_stage else {}
        for k in keys:
            if k != "loss_share":
                payload[k] = sum(float(r[k]) for r in results) / len(results)
        if self.ranks.pp_size > 1:
            box = [payload]
            dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.pp_group)
            payload = box[0]
        loss = torch.tensor([payload["loss"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss, group=self.dp_group)
        payload["loss"] = float(loss) / self.ranks.dp_size
        payload["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        payload["lr"] = lr
        return payload

    # ------------------------------------------------------------------ memory and checkpoints
    def offload_to_cpu(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move parameters, gradient buffers and optimizer state to CPU memory (see offload.py);
        what is in host memory already stays there. A frozen engine has parameters only: `params`
        moves all of its state, and the other groups have nothing to move."""
        self.offloaded = off.offload(self.ddp, self.optimizer if self.trained else None, params, grads, optimizer,
                                     state=self.offloaded)
        if not self.offloaded.entries:
            self.offloaded = None

    def onload(self, groups: tuple[str, ...] | None = None) -> None:
        """Bring back what `offload_to_cpu` moved: everything, or only `groups` (e.g. ("params",)
        for a forward pass or a weight sync, leaving the gradients and optimizer state in host memory)."""
        if self.offloaded is not None:
            off.onload(self.offloaded, self.device, groups)
            if not self.offloaded.entries:
                self.offloaded = None

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer and scheduler state with Megatron distributed checkpointing. No RNG state:
        the workers seed from `trainer.seed` at start, and nothing random in a step depends on the
        worker RNG (the mini-batch shuffle is seeded by the step, rollouts by their call seed, no dropout).
        Not for a frozen engine, which is rebuilt from its initial weights on a resume."""
        self._check_trained("save_checkpoint")
        ckpt.save(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint saved at any TP/PP/DP layout of the same model. A frozen engine loads
        model weights only: `load_hf_weights`, or `megarl.convert.engine_load.load_converted_weights`."""
        self._check_trained("load_checkpoint")
        ckpt.load(self, path)
