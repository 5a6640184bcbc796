"""Model specs: a HF `config.json` -> Megatron `TransformerConfig`, layer spec and weight map.

One YAML per architecture family lives in `model_specs/`. The weight map is data (see
`megarl.models.weight_map`), so conversion and resharding are driven by it, not by branches.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from megarl.config.model_files import rope_settings, spec_dir, unsupported_settings
from megarl.errors import ConfigError
from megarl.models.weight_map import WeightEntry, parse_weight_map


def load_family_specs() -> dict[str, dict[str, Any]]:
    """All family YAMLs by family name."""
    specs: dict[str, dict[str, Any]] = {}
    for path in sorted(spec_dir().glob("*.yaml")):
        with open(path) as f:
            data = yaml.safe_load(f)
        for key in ("family", "model_types", "config_map", "weight_map"):
            if key not in data:
                raise ConfigError(f"model spec {path.name}: missing key '{key}'")
        data["_path"] = str(path)
        specs[data["family"]] = data
    return specs


def supported_model_types() -> list[str]:
    return sorted(t for s in load_family_specs().values() for t in s["model_types"])


def family_of_model_type(model_type: Any) -> str | None:
    """The family whose `model_types` list `model_type`, None when none does."""
    return next((name for name, fam in sorted(load_family_specs().items()) if model_type in fam["model_types"]), None)


def _read_hf_config(hf_config: Any) -> tuple[dict[str, Any], Path | None]:
    """The config as a dict, and the config.json it was read from (None when given as an object)."""
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"HF config not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path}: not a JSON HF config ({err})") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: a HF config is a JSON object, got a {type(config).__name__}")
        return config, path
    if isinstance(hf_config, Mapping):
        return dict(hf_config), None
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict(), None
    raise ConfigError(f"expected a HF config (path, dict or PretrainedConfig), got {type(hf_config)}")


@dataclass
class ModelSpec:
    """An architecture family bound to one HF config."""

    family: str
    hf_config: dict[str, Any]
    config_values: dict[str, Any]  # TransformerConfig fields taken from the HF config
    features: dict[str, bool]  # qkv_bias, qk_layernorm, untied_embeddings
    weight_map: list[WeightEntry]
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    normalization: str
    make_vocab_size_divisible_by: int
    tie_embeddings: bool
    attention_window: int | None = None  # longest sequence the spec computes exactly
    # Llama 3.x RoPE scaling (HF rope_type 'llama3'): factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings; None: plain RoPE. Applied by `scaled_inv_freq`.
    rope_scaling: dict[str, float] | None = None
    source: str = ""  # the family YAML
    extra: dict[str, Any] = field(default_factory=dict)
    config_file: str = ""  # the config.json the HF config was read from; "" when given as a dict

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, hf_config: Any, family: str | None = None) -> "ModelSpec":
        """Map the config with the family named `family` (`model.spec`), or else the family whose
        `model_types` / `architectures` list the config's."""
        cfg, path = _read_hf_config(hf_config)
        families = load_family_specs()
        if family is not None:
            if family not in families:
                raise ConfigError(f"model spec {family!r}: no such family in {spec_dir()}; valid: {sorted(families)}")
            return cls._from_family(families[family], cfg, path)
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        for fam in families.values():
            if model_type in fam["model_types"] or any(a in fam.get("architectures", []) for a in archs):
                return cls._from_family(fam, cfg, path)
        supported = ", ".join(
            f"{name} ({'/'.join(f['model_types'])})" for name, f in sorted(families.items())
        )
        raise ConfigError(
            (f"{path}: " if path is not None else "")
            + f"unsupported architecture model_type={model_type!r} architectures={archs}; "
            f"supported families: {supported}"
        )

    @classmethod
    def _from_family(cls, fam: dict[str, Any], cfg: dict[str, Any], path: Path | None = None) -> "ModelSpec":
        where = f"model spec {Path(fam['_path']).name}"
        act = fam.get("activation", "silu")
        if cfg.get("hidden_act", act) != act:
            raise ConfigError(f"{where}: hidden_act={cfg.get('hidden_act')!r}, expected {act!r}")
        unsupported = unsupported_settings(fam, cfg)  # the family's `requires:` table
        if unsupported:
            raise ConfigError(f"{where}: " + "; ".join(unsupported))
        values: dict[str, Any] = {}
        for field_name, rule in fam["config_map"].items():
            values[field_name] = _resolve(rule, cfg, where, field_name)
        if values.get("kv_channels") is None:
            values["kv_channels"] = values["hidden_size"] // values["num_attention_heads"]
        tie = bool(cfg.get("tie_word_embeddings", False))
        features = {
            "qkv_bias": bool(values.get("add_qkv_bias", False)),
            "qk_layernorm": bool(values.get("qk_layernorm", False)),
            "untied_embeddings": not tie,
            "scalar_head": False,
        }
        theta, rope_scaling = rope_settings(cfg, where)
        window = cfg.get("sliding_window")
        if not cfg.get("use_sliding_window", True):
            window = None
        return cls(
            family=fam["family"],
            hf_config=cfg,
            config_values=values,
            features=features,
            weight_map=parse_weight_map(fam["weight_map"], where),
            vocab_size=int(_resolve("vocab_size", cfg, where, "vocab_size")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rotary_base=theta,
            rope_scaling=rope_scaling,
            normalization=fam.get("normalization", "RMSNorm"),
            make_vocab_size_divisible_by=int(fam.get("make_vocab_size_divisible_by", 128)),
            tie_embeddings=tie,
            attention_window=int(window) if window else None,
            source=fam["_path"],
            config_file="" if path is None else str(path),
        )

    # ---------------------------------------------------------------- derived quantities
    @property
    def num_layers(self) -> int:
        return int(self.config_values["num_layers"])

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return int(self.config_values.get("num_moe_experts") or 0)

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocab rounded up so each TP rank holds an equal slice (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def for_role(self, role: str) -> "ModelSpec":
        """The spec of a value or reward model (same trunk, scalar head instead of the LM head)."""
        if role == "policy":
            return self
        import dataclasses

        features = dict(self.features, untied_embeddings=False, scalar_head=True)
        return dataclasses.replace(self, features=features, tie_embeddings=False)

    def active_weight_entries(self) -> list[WeightEntry]:
        return [e for e in self.weight_map if e.when is None or self.features.get(e.when, False)]

    def check_layout(self, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
        """Raise if the model cannot be split `tp` x `pp` ways (and its experts `ep` ways, each
        expert `etp` ways; default: tp)."""
        v = self.config_values
        etp = tp if etp is None else etp
        if self.num_experts:
            if self.num_experts % ep:
                raise ConfigError(f"{self.family}: ep={ep} must divide the number of experts ({self.num_experts})")
            if int(v["moe_ffn_hidden_size"]) % etp:
                name = "tp" if etp == tp else "expert tensor parallel size"
                raise ConfigError(
                    f"{self.family}: {name}={etp} must divide moe_intermediate_size={v['moe_ffn_hidden_size']}")
            # The shared expert is a dense MLP split over the TP ranks (not the expert TP ranks).
            shared = int(v.get("moe_shared_expert_intermediate_size") or 0)
            if shared % tp:
                raise ConfigError(
                    f"{self.family}: tp={tp} must divide shared_expert_intermediate_size={shared}; "
                    f"valid tp: {_divisors(shared)}")
        elif ep != 1:
            raise ConfigError(f"{self.family}: ep={ep} needs a mixture-of-experts model; this one is dense (use ep=1)")
        elif etp != tp:
            raise ConfigError(f"{self.family}: expert tensor parallel size {etp} needs a mixture-of-experts model; "
                              "this one is dense (leave it unset)")
        if v["num_attention_heads"] % tp or v["num_query_groups"] % tp:
            raise ConfigError(
                f"{self.family}: tp={tp} must divide num_attention_heads={v['num_attention_heads']} "
                f"and num_key_value_heads={v['num_query_groups']}"
            )
        if v["ffn_hidden_size"] % tp:
            raise ConfigError(f"{self.family}: tp={tp} must divide intermediate_size={v['ffn_hidden_size']}")
        if self.num_layers % pp:
            raise ConfigError(f"{self.family}: pp={pp} must divide num_hidden_layers={self.num_layers}")

    def scaled_inv_freq(self, inv_freq: Any) -> Any:
        """RoPE inverse frequencies `inv_freq` (float32, one per rotary pair) with this model's
        Llama 3.x scaling applied, as transformers' `_compute_llama3_parameters` does (the same
        operations in the same order); unchanged without scaling. Megatron-Core's own
        `rope_scaling` (0.16) takes the factor only and fixes low_freq_factor=1, high_freq_factor=4,
        original_max_position_embeddings=8192, so `megarl.megatron.model` applies this instead."""
        if self.rope_scaling is None:
            return inv_freq
        import torch  # here, not at the top: the config checks read specs without loading torch

        s = self.rope_scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_context_len = s["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low
        high_freq_wavelen = old_context_len / high
        wavelen = 2 * math.pi / inv_freq
        # Wavelengths above low_freq_wavelen: divided by factor; below high_freq_wavelen: kept;
        # in between: interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)

    # ---------------------------------------------------------------- Megatron objects
    def transformer_config(self, tp: int = 1, pp: int = 1, cp: int = 1, params_dtype: Any = None,
                           ep: int = 1, sequence_parallel: bool = False,
                           recompute_granularity: str | None = None, etp: int | None = None,
                           **overrides: Any) -> Any:
        """A Megatron `TransformerConfig` for this model at the given layout.

        Fusions and CUDA-only features are switched off without CUDA. `ep`: expert parallel size;
        `etp`: expert tensor parallel size (None: tp).
        `sequence_parallel`: Megatron's sequence parallelism (tp > 1; the local layer spec needs
        norms that allow it, see `megarl.megatron.model`). `recompute_granularity`: None, "full"
        (every layer recomputed from its input: method "uniform", one layer per unit) or
        "selective" (core attention only, Megatron's default recompute_modules).
        """
        import torch
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        self.check_layout(tp, pp, ep, etp)
        on_gpu = torch.cuda.is_available()
        params_dtype = params_dtype or torch.float32
        kwargs: dict[str, Any] = dict(self.config_values)
        kwargs.update(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            normalization=self.normalization,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            pipeline_dtype=params_dtype,
            use_cpu_initialization=not on_gpu,
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            sequence_parallel=sequence_parallel,
            # Micro-batches differ in length (padding is trimmed per micro-batch); PP then
            # exchanges shapes first. The MoE allgather dispatcher refuses this flag.
            variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall",
        )
        if recompute_granularity == "full":
            kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        elif recompute_granularity is not None:
            kwargs.update(recompute_granularity=recompute_granularity)
        if self.num_experts:
            from megarl.megatron.cpu_compat import define_missing_te_symbols

            define_missing_te_symbols()
            kwargs.update(
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=tp if etp is None else etp,
                # Dropless token-choice routing as in HF; no load-balancing loss in RL updates.
                moe_grouped_gemm=False,
                moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0,
                moe_router_dtype="fp32",
                moe_permute_fusion=False,
            )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def layer_spec(self, use_te: bool | None = None) -> Any:
        """TransformerEngine layer spec when TE is installed and CUDA is present, else local."""
        from megatron.core.models.gpt import gpt_layer_specs

        if use_te is None:
            use_te = te_available()
        experts = self.num_experts or None
        if use_te:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
                num_experts=experts, moe_grouped_gemm=False, qk_layernorm=self.features["qk_layernorm"]
            )
        return gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=self.features["qk_layernorm"],
            normalization=self.normalization,
        )


def te_available() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _resolve(rule: Any, cfg: Mapping[str, Any], where: str, field_name: str) -> Any:
    if isinstance(rule, dict):
        if "value" in rule:
            return rule["value"]
        if "negate" in rule:  # a boolean that Megatron states the other way round
            found = cfg.get(rule["negate"])
            return not bool(found if found is not None else rule.get("default", False))
        key = rule["optional"]
        return cfg.get(key) if cfg.get(key) is not None else rule.get("default")
    keys = rule if isinstance(rule, list) else [rule]
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    raise ConfigError(f"{where}: HF config lacks '{keys[0]}' (needed for {field_name})")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
