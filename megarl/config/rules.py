"""What the config rules share: the `Rules` collector each rule appends its message to, and the
helpers that read a config the same way for the rules and for the driver (the roles enabled, a role's
Megatron layout, a pool's size, the model's HF config, a sequence's length under context parallelism).

Checks nothing itself; the rules are in `validate` (the entry point, `validate_config`),
`layout_rules`, `rollout_rules` and `algorithm_rules`. Imports nothing heavy, and none of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from megarl.convert import HF_FILES_DIR, MEGATRON_MARKER
from megarl.errors import ConfigError


def cp_padded_length(length: int, cp: int) -> int:
    """`length` padded for context parallelism: a multiple of 2*CP (1 without CP); the arithmetic of
    megarl.megatron.context_parallel.padded_length, which imports torch (a test keeps them equal)."""
    align = 2 * cp if cp > 1 else 1
    return -(-length // align) * align


def divisors(n: int) -> str:
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


def dir_hf_config(r: Rules, path: str, key: str) -> Optional[dict[str, Any]]:
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


class Rules:
    """The config `cfg` under check and the messages of the rules it breaks, in the order they ran."""

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


def as_dict(node: Any) -> dict:
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
