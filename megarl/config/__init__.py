"""Typed experiment configuration: schema, YAML loading with `extends`, overrides, validation."""

from megarl.config.loader import all_keys, load_config, suggest_key, to_yaml
from megarl.config.rules import critic_enabled, model_hf_config, ref_enabled
from megarl.config.schema import ExperimentConfig
from megarl.config.validate import validate_config

__all__ = [
    "ExperimentConfig",
    "all_keys",
    "critic_enabled",
    "load_config",
    "model_hf_config",
    "ref_enabled",
    "suggest_key",
    "to_yaml",
    "validate_config",
]
