"""Where every row of a sharded tensor comes from, in HF coordinates.

Both sides of a reshard are described the same way: a local tensor (a Megatron shard on a training
rank, or an engine parameter on a rollout rank) is a concatenation, along one axis, of blocks of
HF tensors. A `Block` says "rows [start, stop) along `axis` of HF tensor `hf_name` sit at
`offset` along `axis` of this local tensor". Rows of the local tensor no block covers are padding
(vocabulary padding) and stay zero.

The axis of an HF tensor is its tensor-parallel axis in the weight map (0 for replicated tensors),
the same on both sides, so blocks of the two sides can be intersected as plain ranges.

Fusion orders handled here (see `megarl.models.weight_map` and the vLLM model code):
- Megatron `qkv_per_group`: per query group g, rows [q heads of g, k head g, v head g]; a TP rank
  holds whole groups as one contiguous row block of the fused tensor.
- Megatron `gate_up`: TP rank r holds [gate_r; up_r].
- vLLM `qkv_proj` on rollout TP rank r: [q_r | k_r | v_r] rows (k/v replicated when there are
  fewer key/value heads than rollout TP ranks); `gate_up_proj`: [gate_r | up_r] rows.
- vLLM vocabulary: padded to a multiple of 64, rank r holds rows [r * P/TP_r, (r+1) * P/TP_r).
- vLLM routed experts (`FusedMoE`, tensor-parallel, not expert-parallel): every rank holds every
  expert, `mlp.experts.routed_experts.w13_weight` (E, 2 I/TP_r, H) with expert e = [gate_r | up_r]
  rows and `...w2_weight` (E, H, I/TP_r) with expert e = down_proj columns r (vLLM 0.32's
  `RoutedExperts._load_w13` / `_load_w2`, before the kernel's own post-processing). One engine
  tensor per expert: `...w13_weight[e]`, an expert of the parameter (`vllm_expert_view`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megarl.errors import ConfigError
from megarl.layout import VLLM_VOCAB_PADDING
from megarl.models.weight_map import WeightEntry, qkv_dims, stage_entries

if TYPE_CHECKING:
    from megarl.models.spec import ModelSpec

# vLLM parameter names of fused tensors: the HF name of the first part with this substitution.
VLLM_FUSED_RENAME = {"qkv_per_group": ("q_proj", "qkv_proj"), "gate_up": ("gate_proj", "gate_up_proj")}
ENGINES = ("hf", "vllm")


@dataclass(frozen=True, slots=True)
class Block:
    """Rows [start, stop) along `axis` of HF tensor `hf_name`, at `offset` in a local tensor."""

    hf_name: str
    start: int
    stop: int
    offset: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """A tensor on one rank (Megatron shard or engine parameter) described by its HF blocks."""

    name: str
    shape: tuple[int, ...]
    axis: int
    blocks: tuple[Block, ...]

    @property
    def covered_rows(self) -> int:
        return sum(b.length for b in self.blocks)


def hf_tensor_shapes(spec: "ModelSpec") -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for the policy model of `spec`, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(spec.hf_config)
    model_type = cfg.pop("model_type")
    for key in ("architectures", "transformers_version", "_name_or_path"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from megarl.models.weight_map import split_fused_experts

    return split_fused_experts({name: tuple(t.shape) for name, t in model.state_dict().items()})


def entry_axis(entry: WeightEntry) -> int:
    return entry.tp_axis if entry.tp_axis is not None else 0


def _shape_with(hf_shape: tuple[int, ...], axis: int, length: int) -> tuple[int, ...]:
    shape = list(hf_shape)
    shape[axis] = length
    return tuple(shape)


def _window(blocks: list[Block], start: int, stop: int, new_offset: int) -> list[Block]:
    """The part of `blocks` (offsets in some tensor) within [start, stop), re-based at `new_offset`."""
    out = []
    for b in blocks:
        lo, hi = max(b.offset, start), min(b.offset + b.length, stop)
        if lo < hi:
            out.append(Block(b.hf_name, b.start + lo - b.offset, b.start + hi - b.offset, new_offset + lo - start))
    return out


def _unsplit_blocks(entry: WeightEntry, hf_names: list[str], shapes: dict[str, tuple[int, ...]],
                    spec: "ModelSpec") -> list[Block]:
    """Blocks of the unsplit (TP=1) Megatron tensor, in Megatron's fusion order."""
    axis = entry_axis(entry)
    if entry.fusion == "none":
        return [Block(hf_names[0], 0, shapes[hf_names[0]][axis], 0)]
    if entry.fusion == "gate_up":
        n = shapes[hf_names[0]][0]
        return [Block(hf_names[0], 0, n, 0), Block(hf_names[1], 0, n, n)]
    groups, per_group, hd = qkv_dims(spec)
    q, k, v = hf_names
    out, offset = [], 0
    for g in range(groups):
        for name, start, length in ((q, g * per_group * hd, per_group * hd), (k, g * hd, hd), (v, g * hd, hd)):
            out.append(Block(name, start, start + length, offset))
            offset += length
    return out


def megatron_shards(spec: "ModelSpec", tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                    shapes: dict[str, tuple[int, ...]], ep_rank: int = 0, ep_size: int = 1,
                    experts: bool | None = None) -> list[LocalTensor]:
    """Every Megatron parameter of training model shard (tp_rank, pp_rank) and expert-parallel rank
    `ep_rank`, by local-spec name (stage-local layer and expert indices), with its HF blocks.
    Shapes are the local shard's shapes. `experts`: only the per-expert weights (True), only the
    others (False), or all (None)."""
    out = []
    padded_vocab = spec.padded_vocab_size(tp_size)
    if experts is False and spec.num_experts:
        # Expert weights are skipped below: expand each to a single expert (as if ep = experts).
        ep_rank, ep_size = 0, spec.num_experts
    for entry, name, hf_names in stage_entries(spec, pp_rank, pp_size, ep_rank=ep_rank, ep_size=ep_size):
        if experts is not None and entry.per_expert != experts:
            continue
        axis = entry_axis(entry)
        blocks = _unsplit_blocks(entry, hf_names, shapes, spec)
        full = padded_vocab if entry.vocab_padded else sum(b.length for b in blocks)
        if entry.tp_axis is None or tp_size == 1:
            local, length = blocks, full
        elif entry.fusion == "gate_up":  # [gate_r; up_r]
            half = full // 2
            part = half // tp_size
            local = _window(blocks, tp_rank * part, (tp_rank + 1) * part, 0)
            local += _window(blocks, half + tp_rank * part, half + (tp_rank + 1) * part, part)
            length = 2 * part
        else:
            if full % tp_size:
                raise ConfigError(f"{name}: {full} rows along axis {axis} not divisible by tp={tp_size}")
            length = full // tp_size
            local = _window(blocks, tp_rank * length, (tp_rank + 1) * length, 0)
        out.append(LocalTensor(name, _shape_with(shapes[hf_names[0]], axis, length), axis, tuple(local)))
    return out


def engine_params(spec: "ModelSpec", engine: str, tp_rank: int, tp_size: int,
                  shapes: dict[str, tuple[int, ...]]) -> list[LocalTensor]:
    """The parameters one rollout rank holds, with their HF blocks.

    engine "hf": HF-named full tensors (needs tp_size == 1); tied embeddings give only
    `model.embed_tokens.weight`. engine "vllm": vLLM's per-rank parameters (fused qkv_proj and
    gate_up_proj, padded vocabulary).
    """
    if engine not in ENGINES:
        raise ConfigError(f"rollout engine layout {engine!r} unknown; valid: {ENGINES}")
    if engine == "hf" and tp_size != 1:
        raise ConfigError(f"engine layout 'hf' holds full tensors and needs rollout tp=1, got tp={tp_size}")
    out = []
    for entry, _, hf_names in stage_entries(spec, 0, 1):  # the whole model, global layer indices
        axis = entry_axis(entry)
        if engine == "hf":
            for name in hf_names:
                out.append(LocalTensor(name, shapes[name], axis, (Block(name, 0, shapes[name][axis], 0),)))
            continue
        param = _vllm_param(spec, entry, hf_names, tp_rank, tp_size, shapes)
        if entry.per_expert:
            param = LocalTensor(_vllm_expert_name(hf_names[0]), param.shape, param.axis, param.blocks)
        out.append(param)
    return out


# HF per-expert leaf -> vLLM fused expert parameter (FusedMoE's expert params mapping).
_VLLM_EXPERT_PARAM = {"gate_proj": "w13_weight", "down_proj": "w2_weight"}


def _vllm_expert_name(hf_name: str) -> str:
    """`model.layers.3.mlp.experts.5.gate_proj.weight` -> `model.layers.3.mlp.experts.routed_experts.w13_weight[5]`."""
    stem, rest = hf_name.split(".experts.", 1)
    expert, leaf, _ = rest.split(".")
    return f"{stem}.experts.routed_experts.{_VLLM_EXPERT_PARAM[leaf]}[{expert}]"


def vllm_expert_view(name: str) -> tuple[str, int] | None:
    """(vLLM parameter name, expert index) of a per-expert engine tensor name, else None."""
    if not name.endswith("]") or "[" not in name:
        return None
    base, index = name[:-1].rsplit("[", 1)
    return base, int(index)


def _vllm_param(spec: "ModelSpec", entry: WeightEntry, hf_names: list[str], tp_rank: int, tp_size: int,
                shapes: dict[str, tuple[int, ...]]) -> LocalTensor:
    axis = entry_axis(entry)
    first = hf_names[0]
    if entry.fusion == "none":
        n = shapes[first][axis]
        if entry.tp_axis is None:
            return LocalTensor(first, shapes[first], axis, (Block(first, 0, n, 0),))
        total = math.ceil(n / VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING if entry.vocab_padded else n
        if total % tp_size:
            raise ConfigError(f"{first}: {total} rows along axis {axis} not divisible by rollout tp={tp_size}")
        per = total // tp_size
        blocks = _window([Block(first, 0, n, 0)], tp_rank * per, (tp_rank + 1) * per, 0)
        return LocalTensor(first, _shape_with(shapes[first], axis, per), axis, tuple(blocks))
    old, new = VLLM_FUSED_RENAME[entry.fusion]
    name = first.replace(old, new)
    if entry.fusion == "gate_up":
        n = shapes[first][0]
        if n % tp_size:
            raise ConfigError(f"{first}: intermediate size {n} not divisible by rollout tp={tp_size}")
        per = n // tp_size
        blocks = (Block(hf_names[0], tp_rank * per, (tp_rank + 1) * per, 0),
                  Block(hf_names[1], tp_rank * per, (tp_rank + 1) * per, per))
        return LocalTensor(name, _shape_with(shapes[first], 0, 2 * per), 0, blocks)
    groups, per_group, hd = qkv_dims(spec)
    heads = groups * per_group
    if heads % tp_size:
        raise ConfigError(f"{first}: {heads} attention heads not divisible by rollout tp={tp_size}")
    q_rows = heads // tp_size * hd
    if groups >= tp_size:
        if groups % tp_size:
            raise ConfigError(f"{first}: {groups} key/value heads not divisible by rollout tp={tp_size}")
        kv_rows, kv_start = groups // tp_size * hd, tp_rank * (groups // tp_size) * hd
    else:  # vLLM replicates each key/value head over tp/groups consecutive ranks
        if tp_size % groups:
            raise ConfigError(f"{first}: rollout tp={tp_size} must be a multiple of {groups} key/value heads")
        kv_rows, kv_start = hd, (tp_rank // (tp_size // groups)) * hd
    q, k, v = hf_names
    blocks = (Block(q, tp_rank * q_rows, (tp_rank + 1) * q_rows, 0),
              Block(k, kv_start, kv_start + kv_rows, q_rows),
              Block(v, kv_start, kv_start + kv_rows, q_rows + kv_rows))
    return LocalTensor(name, _shape_with(shapes[first], 0, q_rows + 2 * kv_rows), 0, blocks)
