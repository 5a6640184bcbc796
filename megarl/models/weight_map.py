"""Weight map: how each Megatron parameter is made from HF tensors, and how it is split over TP.

Fusion kinds:
- "none": one HF tensor, same layout.
- "qkv_per_group": q, k, v projections fused per query group, rows [q x heads_per_group, k, v]
  for each group in turn. A TP rank holds whole groups as a contiguous row block.
- "gate_up": [gate; up] rows; TP rank r holds [gate_r; up_r].
TP split: `tp_axis` 0 (column-parallel, rows), 1 (row-parallel, columns) or None (replicated).
Vocab-padded tensors get zero rows up to the padded vocab size before the split.

Mixture-of-experts entries carry `{expert}` in both names: one Megatron parameter per local expert
(`local_experts.{expert}`, index within this expert-parallel rank) made from the HF tensors of the
global expert `ep_rank * experts_per_rank + expert` (HF checkpoints store experts one by one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from megarl.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from megarl.models.spec import ModelSpec

FUSIONS = ("none", "qkv_per_group", "gate_up")
STAGES = ("first", "last", "layer")


@dataclass(frozen=True)
class WeightEntry:
    """One Megatron parameter (a template with `{layer}` for decoder layers)."""

    megatron: str
    hf: tuple[str, ...]
    fusion: str = "none"
    tp_axis: int | None = None
    vocab_padded: bool = False
    stage: str = "layer"  # first | last | layer (decoder layers, split over PP)
    when: str | None = None
    te_name: str | None = None
    ckpt_name: str | None = None  # the distributed-checkpoint key, where Megatron maps the name

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.megatron


def parse_weight_map(raw: Iterable[Mapping[str, Any]], where: str) -> list[WeightEntry]:
    entries = []
    for i, item in enumerate(raw):
        fusion = item.get("fusion", "none")
        if fusion not in FUSIONS:
            raise ConfigError(f"{where}: weight_map[{i}] fusion={fusion!r}, valid: {FUSIONS}")
        stage = item.get("stage", "layer" if "{layer}" in item["megatron"] else "first")
        if stage not in STAGES:
            raise ConfigError(f"{where}: weight_map[{i}] stage={stage!r}, valid: {STAGES}")
        axis = item.get("tp_axis")
        if axis not in (0, 1, None):
            raise ConfigError(f"{where}: weight_map[{i}] tp_axis={axis!r}, valid: 0, 1, null")
        expert_sides = ["{expert}" in item["megatron"], all("{expert}" in h for h in item["hf"])]
        if any(expert_sides) and not all(expert_sides):
            raise ConfigError(f"{where}: weight_map[{i}] uses {{expert}} on one side only; a per-expert "
                              "entry needs it in the megatron name and in every hf name")
        if expert_sides[0] and "{layer}" not in item["megatron"]:
            raise ConfigError(f"{where}: weight_map[{i}] is per expert but not per layer ({{layer}} missing)")
        entries.append(
            WeightEntry(
                megatron=item["megatron"],
                hf=tuple(item["hf"]),
                fusion=fusion,
                tp_axis=axis,
                vocab_padded=bool(item.get("vocab_padded", False)),
                stage=stage,
                when=item.get("when"),
                te_name=item.get("te_name"),
                ckpt_name=item.get("ckpt_name"),
            )
        )
    return entries


# ------------------------------------------------------------------ fusion (whole tensors)
def qkv_dims(spec: "ModelSpec") -> tuple[int, int, int]:
    v = spec.config_values
    groups = int(v["num_query_groups"])
    return groups, int(v["num_attention_heads"]) // groups, int(v["kv_channels"])


def fuse(entry: WeightEntry, parts: list[torch.Tensor], spec: "ModelSpec") -> torch.Tensor:
    """HF tensors -> the unsplit Megatron tensor (TP=1 layout)."""
    if entry.fusion == "none":
        return parts[0]
    if entry.fusion == "gate_up":
        return torch.cat(parts, dim=0)
    groups, per_group, head_dim = qkv_dims(spec)
    q, k, v = parts
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * head_dim, *tail)
    k = k.reshape(groups, head_dim, *tail)
    v = v.reshape(groups, head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(groups * (per_group + 2) * head_dim, *tail)


def unfuse(entry: WeightEntry, full: torch.Tensor, spec: "ModelSpec") -> list[torch.Tensor]:
    """The unsplit Megatron tensor -> HF tensors (inverse of `fuse`)."""
    if entry.fusion == "none":
        return [full]
    if entry.fusion == "gate_up":
        return list(full.chunk(2, dim=0))
    groups, per_group, head_dim = qkv_dims(spec)
    tail = full.shape[1:]
    grouped = full.reshape(groups, (per_group + 2) * head_dim, *tail)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return [
        q.reshape(groups * per_group * head_dim, *tail).contiguous(),
        k.reshape(groups * head_dim, *tail).contiguous(),
        v.reshape(groups * head_dim, *tail).contiguous(),
    ]


# ------------------------------------------------------------------ TP split / merge
def tp_shard(entry: WeightEntry, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of the unsplit Megatron tensor that TP rank `tp_rank` holds."""
    if entry.tp_axis is None or tp_size == 1:
        return full.clone()
    if entry.fusion == "gate_up":  # each rank: [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0).clone()
    if full.shape[entry.tp_axis] % tp_size:
        raise ConfigError(f"{entry.megatron}: dim {entry.tp_axis} of {tuple(full.shape)} not divisible by tp={tp_size}")
    return full.chunk(tp_size, dim=entry.tp_axis)[tp_rank].clone()


def tp_merge(entry: WeightEntry, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `tp_shard` over all TP ranks' shards (in rank order)."""
    if entry.tp_axis is None or len(shards) == 1:
        return shards[0]
    if entry.fusion == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=entry.tp_axis)


def pad_vocab(full: torch.Tensor, padded_size: int) -> torch.Tensor:
    if full.shape[0] == padded_size:
        return full
    pad = full.new_zeros((padded_size - full.shape[0], *full.shape[1:]))
    return torch.cat([full, pad], dim=0)


# ------------------------------------------------------------------ layers and stages
def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global indices of the decoder layers on pipeline stage `pp_rank` (even split)."""
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def expert_range(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """Global indices of the experts held by expert-parallel rank `ep_rank` (even split)."""
    if ep_size < 1 or num_experts % ep_size:
        raise ConfigError(f"ep={ep_size} must divide the number of experts ({num_experts})")
    per = num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def split_fused_experts(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """transformers >= 5 keeps a MoE layer's experts fused in memory (`mlp.experts.gate_up_proj`
    (E, 2I, H), `mlp.experts.down_proj` (E, H, I)) and writes them one by one in checkpoints
    (`mlp.experts.{e}.gate_proj.weight`, ...). Shapes by checkpoint name."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        stem, _, leaf = name.rpartition(".")
        if stem.endswith(".experts") and leaf == "gate_up_proj" and len(shape) == 3:
            experts, rows, cols = shape
            for e in range(experts):
                out[f"{stem}.{e}.gate_proj.weight"] = (rows // 2, cols)
                out[f"{stem}.{e}.up_proj.weight"] = (rows // 2, cols)
        elif stem.endswith(".experts") and leaf == "down_proj" and len(shape) == 3:
            for e in range(shape[0]):
                out[f"{stem}.{e}.down_proj.weight"] = tuple(shape[1:])
        else:
            out[name] = tuple(shape)
    return out


def expand(entry: WeightEntry, pp_rank: int, pp_size: int, num_layers: int,
           te_names: bool = False, num_experts: int = 0, ep_rank: int = 0,
           ep_size: int = 1) -> list[tuple[str, list[str]]]:
    """[(megatron name on this stage, HF names)] for one entry; layer indices are stage-local,
    expert indices local to expert-parallel rank `ep_rank` of `ep_size`.
    `te_names`: use the name of a TransformerEngine-spec model where it differs."""
    if entry.stage == "first" and pp_rank != 0:
        return []
    if entry.stage == "last" and pp_rank != pp_size - 1:
        return []
    template = entry.te_name if te_names and entry.te_name else entry.megatron
    if not entry.per_layer:
        return [(template, list(entry.hf))]
    out = []
    layers = stage_layers(num_layers, pp_rank, pp_size)
    experts = expert_range(num_experts, ep_rank, ep_size) if entry.per_expert else range(1)
    for local, layer in enumerate(layers):
        for local_e, expert in enumerate(experts):
            out.append((template.format(layer=local, expert=local_e),
                        [h.format(layer=layer, expert=expert) for h in entry.hf]))
    return out


def _tied_output_entries(spec: "ModelSpec", pp_rank: int, pp_size: int) -> list[tuple[WeightEntry, str, list[str]]]:
    """With tied embeddings and PP > 1 the last stage holds its own copy of the embedding."""
    if not spec.tie_embeddings or pp_size == 1 or pp_rank != pp_size - 1:
        return []
    emb = next(e for e in spec.weight_map if e.megatron == "embedding.word_embeddings.weight")
    out = next(e for e in spec.weight_map if e.megatron == "output_layer.weight")
    return [(out, out.megatron, list(emb.hf))]


def stage_entries(spec: "ModelSpec", pp_rank: int, pp_size: int, te_names: bool = False,
                  ep_rank: int = 0, ep_size: int = 1) -> list[tuple[WeightEntry, str, list[str]]]:
    """Every (entry, megatron name, HF names) held by pipeline stage `pp_rank` (and, for expert
    weights, expert-parallel rank `ep_rank` of `ep_size`)."""
    items = []
    for entry in spec.active_weight_entries():
        for name, hf in expand(entry, pp_rank, pp_size, spec.num_layers, te_names, spec.num_experts,
                               ep_rank, ep_size):
            items.append((entry, name, hf))
    return items + _tied_output_entries(spec, pp_rank, pp_size)


# ------------------------------------------------------------------ whole state dicts
def hf_to_megatron_state_dict(
    hf_sd: Mapping[str, torch.Tensor], spec: "ModelSpec", tp_rank: int, tp_size: int,
    pp_rank: int, pp_size: int, skip: Iterable[str] = (), te_names: bool = False,
    ep_rank: int = 0, ep_size: int = 1, etp_rank: int | None = None, etp_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """HF tensors -> this (tp_rank, pp_rank, ep_rank)'s Megatron state dict (local-spec names, or
    TransformerEngine-spec names with `te_names`). Expert weights are split over the expert
    tensor-parallel ranks (`etp_rank` of `etp_size`; default: the TP rank and size). Megatron names
    in `skip` are left out."""
    if etp_size is None:
        etp_rank, etp_size = tp_rank, tp_size
    spec.check_layout(tp_size, pp_size, ep_size, etp_size)
    out: dict[str, torch.Tensor] = {}
    padded = spec.padded_vocab_size(tp_size)
    skipped = set(skip)
    for entry, name, hf_names in stage_entries(spec, pp_rank, pp_size, te_names, ep_rank, ep_size):
        if name in skipped:
            continue
        missing = [h for h in hf_names if h not in hf_sd]
        if missing:
            raise CheckpointError(f"HF weights lack {missing} (needed for Megatron {name})")
        full = fuse(entry, [hf_sd[h] for h in hf_names], spec)
        if entry.vocab_padded:
            full = pad_vocab(full, padded)
        out[name] = (tp_shard(entry, full, etp_rank, etp_size) if entry.per_expert
                     else tp_shard(entry, full, tp_rank, tp_size))
    return out


def megatron_to_hf_state_dict(
    shards: list[list[Mapping[str, torch.Tensor]]], spec: "ModelSpec", te_names: bool = False
) -> dict[str, torch.Tensor]:
    """All ranks' Megatron state dicts, `shards[pp_rank][tp_rank]`, -> one HF state dict.
    Expert weights: every shard must hold all experts (expert parallel size 1)."""
    pp_size, tp_size = len(shards), len(shards[0])
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp_size):
        for entry, name, hf_names in stage_entries(spec, pp_rank, pp_size, te_names):
            if hf_names[0] in out:  # the tied copy of the embedding on the last stage
                continue
            full = tp_merge(entry, [shards[pp_rank][t][name] for t in range(tp_size)])
            if entry.vocab_padded:
                full = full[: spec.vocab_size]
            for hf_name, part in zip(hf_names, unfuse(entry, full, spec)):
                out[hf_name] = part.contiguous()
    if spec.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def read_hf_tensors(hf_dir: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only `names` from the safetensors files in `hf_dir` (sharded or single-file)."""
    import json

    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    wanted = set(names)
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            where = json.load(f)["weight_map"]
    else:
        single = hf_dir / "model.safetensors"
        if not single.exists():
            raise CheckpointError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
        where = {n: single.name for n in wanted}
    missing = sorted(n for n in wanted if n not in where)
    if missing:
        raise CheckpointError(f"{hf_dir}: safetensors index lacks {missing[:5]}")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        by_file.setdefault(where[n], []).append(n)
    for fname, keys in by_file.items():
        with safe_open(str(hf_dir / fname), framework="pt") as f:
            available = set(f.keys())
            for k in keys:
                if k not in available:
                    raise CheckpointError(f"{hf_dir / fname}: tensor {k} not found")
                out[k] = f.get_tensor(k)
    return out
