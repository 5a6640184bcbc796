"""Which tensors a Megatron distributed checkpoint of a model holds, under which keys and shapes.

The checkpoint stores every parameter in its unsplit (TP=1) layout, decoder layers stacked on a
leading axis of `num_layers` (the global layer index), under the name a TransformerEngine-spec
model uses (the norms live inside `linear_qkv` / `linear_fc1` there). This is what the engine's
`sharded_state_dict()` describes, so a checkpoint written from this plan loads at any TP/PP.
Vocabulary-sized tensors are zero-padded to the padded vocabulary of the TP size chosen at
conversion; Megatron accepts another padding when it loads (`allow_shape_mismatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from megarl.errors import CheckpointError, ConfigError
from megarl.models.spec import ModelSpec, family_of_model_type, load_family_specs
from megarl.models.weight_map import WeightEntry, expand, fuse

ROLES = ("policy", "value")


@dataclass(frozen=True)
class CheckpointTensor:
    """One key of the checkpoint and the HF tensors it is made of."""

    key: str
    entry: WeightEntry
    hf_names: tuple[tuple[str, ...], ...]  # one tuple per decoder layer (x expert), or a single one
    part_shape: tuple[int, ...]  # one layer's (one expert's) unsplit Megatron tensor (vocab padded)
    stacked: bool  # decoder layers stacked on axis 0
    experts: int = 0  # > 0: experts stacked on axis 1 (hf_names are layer-major)

    @property
    def lead_shape(self) -> tuple[int, ...]:
        """The stacking axes in front of `part_shape`: (), (layers,) or (layers, experts)."""
        if not self.stacked:
            return ()
        if self.experts:
            return (len(self.hf_names) // self.experts, self.experts)
        return (len(self.hf_names),)

    def lead_index(self, i: int) -> tuple[int, ...]:
        """Position of `hf_names[i]` on the stacking axes."""
        if not self.stacked:
            return ()
        return divmod(i, self.experts) if self.experts else (i,)

    @property
    def global_shape(self) -> tuple[int, ...]:
        return (*self.lead_shape, *self.part_shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.global_shape:
            n *= s
        return n


def checkpoint_key(entry: WeightEntry) -> str:
    """The checkpoint key of a weight-map entry (layer index removed, TE names for norms; experts
    under `experts.experts.`, Megatron's key for its sequential experts)."""
    name = entry.ckpt_name or entry.te_name or entry.megatron
    return name.replace("{layer}.", "").replace("local_experts.{expert}.", "experts.")


def role_of_architecture(architecture: str | None) -> str:
    """policy for *ForCausalLM, value for a scalar-head model (*ForSequenceClassification)."""
    if architecture and architecture.endswith(("ForSequenceClassification", "ForTokenClassification")):
        return "value"
    return "policy"


def head_architecture(architecture: str, role: str) -> str:
    """The HF class name for `role` in the same family (Qwen2ForCausalLM -> Qwen2ForSequenceClassification)."""
    stem = architecture
    for suffix in ("ForCausalLM", "ForSequenceClassification", "ForTokenClassification"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    return stem + ("ForCausalLM" if role == "policy" else "ForSequenceClassification")


def family_architecture(spec: ModelSpec, role: str) -> str:
    """The HF class of `spec`'s family in `role`, for a config that names none (`architectures`
    missing or null, as `save_pretrained` of a config made on its own writes): the first class the
    family's YAML lists, in its head for `role`."""
    listed = load_family_specs()[spec.family].get("architectures") or []
    if not listed:
        raise ConfigError(
            f"{spec.config_file or 'the HF config'}: no 'architectures' entry, and model spec "
            f"{Path(spec.source).name} lists no class to take instead; add the model's transformers class to the "
            'config, e.g. "architectures": ["LlamaForCausalLM"] ("LlamaForSequenceClassification" for a value or '
            "reward model)"
        )
    return head_architecture(listed[0], role)


def plan_checkpoint(spec: ModelSpec, role: str, hf_shapes: Mapping[str, tuple[int, ...]], tp: int,
                    optional_hf: tuple[str, ...] = ()) -> list[CheckpointTensor]:
    """Every checkpoint tensor of `spec` in `role`, with shapes derived from the HF shapes.

    Entries whose HF tensors are all in `optional_hf` and absent from `hf_shapes` are left out
    (a value model started from a policy has no scalar head yet). Raises ConfigError when the
    model of `hf_shapes` lacks a tensor the family's weight map needs (a config of another family).
    """
    if role not in ROLES:
        raise CheckpointError(f"role={role!r}, valid: {ROLES}")
    role_spec = spec.for_role(role)
    wanted = []  # (entry, one row of HF names per layer [x expert])
    for entry in role_spec.active_weight_entries():
        rows = [tuple(hf) for _, hf in expand(entry, 0, 1, role_spec.num_layers, num_experts=role_spec.num_experts)]
        if not all(n in optional_hf and n not in hf_shapes for row in rows for n in row):
            wanted.append((entry, rows))
    needed = [n for _, rows in wanted for row in rows for n in row]
    missing = [n for n in needed if n not in hf_shapes]
    if missing:
        raise ConfigError(_other_family_message(role_spec, missing, len(needed)))
    plan = []
    for entry, rows in wanted:
        parts = [torch.empty(hf_shapes[n], device="meta") for n in rows[0]]
        shape = list(fuse(entry, parts, role_spec).shape)
        if entry.vocab_padded:
            shape[0] = role_spec.padded_vocab_size(tp)
        experts = role_spec.num_experts if entry.per_expert else 0
        plan.append(CheckpointTensor(checkpoint_key(entry), entry, tuple(rows), tuple(shape), entry.per_layer, experts))
    return plan


def _other_family_message(spec: ModelSpec, missing: list[str], needed: int) -> str:
    """Why a family's weight map does not fit a HF config, and which family would."""
    model_type = spec.hf_config.get("model_type")
    config = spec.config_file or "the HF config"
    owner = family_of_model_type(model_type)
    if owner == spec.family:
        hint = f"model_type {model_type!r} is this family's own, yet the model lacks these tensors"
    elif owner is not None:
        hint = (f"a config of another family: its model_type {model_type!r} is listed by family {owner!r} "
                f"({Path(load_family_specs()[owner]['_path']).name})")
    else:
        hint = f"no family lists its model_type {model_type!r}"
    return (f"model spec {Path(spec.source).name} (family {spec.family!r}) does not fit {config}: the model it "
            f"describes has no HF tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} ({len(missing)} of the "
            f"{needed} the family's weight map reads); {hint}")
