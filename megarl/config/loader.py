"""Load an experiment: YAML files that may extend a base file, then dotted command-line overrides.

    cfg = load_config("configs/quickstart_cpu.yaml", ["actor.optim.lr=1e-6", "rollout.n=8"])

A YAML file may start with ``extends: base.yaml`` (or a list of files), resolved relative to the file;
the bases are merged first, then the file. Keys are checked against the schema file by file, so an
error names the file (or the override) that set the bad key.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megarl.config.schema import ExperimentConfig
from megarl.errors import ConfigError

EXTENDS_KEY = "extends"


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _dataclass_of(tp: Any) -> Optional[type]:
    """The dataclass inside ``tp`` (``X`` or ``Optional[X]``), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def all_keys(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (leaves and sections)."""
    keys = []
    for name, tp in _field_types(cls).items():
        key = f"{prefix}{name}"
        keys.append(key)
        sub = _dataclass_of(tp)
        if sub is not None:
            keys.extend(all_keys(sub, key + "."))
    return keys


# Short names people type for long keys.
_ABBREVIATIONS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "dp": "data_parallel_size",
    "lr": "lr",
}


def suggest_key(bad_key: str) -> Optional[str]:
    """The nearest valid dotted key to ``bad_key``.

    Order: the same leaf name deeper in the same section (``actor.lr`` -> ``actor.optim.lr``), a close
    sibling (``rollout.temprature`` -> ``rollout.temperature``), the same leaf anywhere, anything close.
    """
    known = all_keys()
    parent, _, leaf = bad_key.rpartition(".")
    leaf = _ABBREVIATIONS.get(leaf, leaf)
    if f"{parent}.{leaf}" in known:
        return f"{parent}.{leaf}"
    same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]
    in_section = [k for k in same_leaf if parent and k.startswith(parent + ".")]
    if in_section:
        return min(in_section, key=len)
    # Leaves against leaves: whole keys share their parent, which made any leaf look close to any
    # sibling (`reward_model.overlong_buffer` -> `reward_model.enable`).
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]
    if same_leaf:
        return min(same_leaf, key=len)
    close = difflib.get_close_matches(bad_key, known, n=1, cutoff=0.6)
    return close[0] if close else None


# Keys verl users bring that megarl does not have, with what to do instead.
REMOVED_KEYS: dict[str, str] = {
    "data.dataloader_num_workers": "megarl reads prompts from parquet in the driver process, with no loader "
    "workers; remove the key",
    "actor.use_remove_padding": "use model.use_remove_padding (the same switch for every role)",
    "actor.optim.warmup_style": "use actor.optim.lr_scheduler (constant | cosine | linear)",
    "critic.optim.warmup_style": "use critic.optim.lr_scheduler (constant | cosine | linear)",
    "trainer.n_gpus_per_node": "use resources.actor_pool.devices_per_node",
    "trainer.nnodes": "use resources.actor_pool.nnodes",
    "trainer.log_freq": "every step's metrics go to every tracking backend (tracking.backends), and "
    "trainer.progress_bar shows a bar on a terminal or else a progress line (every 10 steps when the console "
    "backend already prints one per step); remove the key",
    "data.return_raw_chat": "megarl always keeps each row's prompt messages (the batch column raw_prompt, which "
    "multi-turn rollouts and the reward model read); remove the key",
    "reward_model.reward_manager": "megarl has one reward manager. verl's naive is the default; its dapo is "
    "reward.overlong_buffer.enable (with reward.overlong_buffer.len and reward.overlong_buffer.penalty_factor) "
    "and, for dynamic sampling, algorithm.filter_groups.enable (algorithm.filter_groups.metric); remove the key",
}

# verl's prefix of the actor, rollout, reference and model keys, which megarl keeps as top-level sections.
VERL_PREFIX = "actor_rollout_ref"

# verl keys (or sections: their keys follow) that megarl spells differently: the megarl key to use.
RENAMED_KEYS: dict[str, str] = {
    "reward_model.overlong_buffer": "reward.overlong_buffer",
    "custom_reward_function": "reward.custom_reward_function",
    "trainer.logger": "tracking.backends",
    "rollout.name": "rollout.engine",
    # verl sizes the old-log-prob pass under rollout; megarl's actor runs it.
    "rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
    # verl's Ulysses splits each sequence over ranks; in megarl, Megatron's context parallelism does.
    "actor.ulysses_sequence_parallel_size": "actor.megatron.context_parallel_size",
    "ref.ulysses_sequence_parallel_size": "ref.megatron.context_parallel_size",
    "critic.ulysses_sequence_parallel_size": "critic.megatron.context_parallel_size",
}


def megarl_spelling(key: str) -> str:
    """``key`` as megarl spells it: verl's ``actor_rollout_ref.`` prefix dropped, then a renamed key
    or section (`RENAMED_KEYS`, longest match) replaced. Unchanged when neither applies."""
    if key.startswith(VERL_PREFIX + "."):
        key = key[len(VERL_PREFIX) + 1:]
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        if head in RENAMED_KEYS:
            return ".".join([RENAMED_KEYS[head], *parts[n:]])
    return key


# Megatron layout options megarl does not offer, refused under any `<role>.megatron` section.
UNSUPPORTED_MEGATRON_KEYS: dict[str, str] = {
    "virtual_pipeline_model_parallel_size": "megarl has no virtual (interleaved) pipeline: each pipeline rank "
    "holds one contiguous stage of layers; remove the key (pipeline_model_parallel_size sets the stages)",
}


def _unknown_key_error(key: str, source: str, typed: Optional[str] = None) -> str:
    """The error for the unknown ``key``; ``typed``: the full key given below it, when only one was
    (a command-line override always gives one), which the hint is about."""
    typed = typed or key
    for given in dict.fromkeys((typed, key, megarl_spelling(typed))):
        if given in REMOVED_KEYS:
            return f"{source}: '{given}' is not a megarl key: {REMOVED_KEYS[given]}"
    parent, _, leaf = key.rpartition(".")
    if parent.rpartition(".")[2] == "megatron" and leaf in UNSUPPORTED_MEGATRON_KEYS:
        return f"{source}: '{key}' is not supported: {UNSUPPORTED_MEGATRON_KEYS[leaf]}"
    msg = f"{source}: unknown key '{key}'"
    if typed == VERL_PREFIX:
        return (f"{msg}: verl's {VERL_PREFIX}.actor, .rollout, .ref and .model are megarl's top-level sections "
                "actor, rollout, ref and model; drop the prefix")
    spelled = megarl_spelling(typed)
    hint = spelled if spelled in all_keys() else suggest_key(spelled)
    return msg + (f"; did you mean '{hint}'?" if hint else "; run `megarl config keys` to list the valid keys")


def _only_leaf(value: Any, key: str) -> Optional[str]:
    """The dotted key of the one value under ``value`` (``key`` itself for a scalar); None for several."""
    while isinstance(value, dict):
        if len(value) != 1:
            return None
        name, value = next(iter(value.items()))
        key = f"{key}.{name}"
    return key


def check_keys(tree: Any, source: str, cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """Names of keys in ``tree`` that the schema does not have, as error messages naming ``source``."""
    if not isinstance(tree, dict):
        return []
    errors = []
    types = _field_types(cls)
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if name not in types:
            errors.append(_unknown_key_error(key, source, _only_leaf(value, key)))
            continue
        sub = _dataclass_of(types[name])
        if sub is not None:
            if value is not None and not isinstance(value, dict):
                errors.append(f"{source}: '{key}' is a section ({sub.__name__}); give a mapping, got {value!r}")
            else:
                errors.extend(check_keys(value, source, sub, key + "."))
    return errors


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _load_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, dict]]:
    """[(source, tree)] in merge order: bases (recursively) first, then the file itself."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"{path}: '{EXTENDS_KEY}' forms a cycle: {chain}")
    data = _read_yaml(path)
    bases = data.pop(EXTENDS_KEY, None) or []
    if isinstance(bases, str):
        bases = [bases]
    out: list[tuple[str, dict]] = []
    for base in bases:
        out.extend(_load_chain((path.parent / base), (*seen, path)))
    out.append((str(path), data))
    return out


def _parse_overrides(overrides: Iterable[str]) -> list[tuple[str, dict]]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command-line override '{item}' must look like key=value (e.g. actor.optim.lr=1e-6)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")
        if not key:
            raise ConfigError(f"command-line override '{item}' has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            first = str(err).splitlines()[0]
            raise ConfigError(f"command-line override '{item}': the value is not valid YAML ({first}); valid: a "
                              "YAML value, e.g. a list [a.parquet, b.parquet], or a string in double quotes inside "
                              "the shell's single quotes when it starts with @, `, [, { or *: "
                              f"{key}='\"{raw}\"'") from None
        tree: dict = {}
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        out.append((f"command-line override '{item}'", tree))
    return out


def _type_error(err: OmegaConfBaseException, source: str) -> str:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    return f"{source}: {key}: {msg}"


def load_config(path: Optional[str | Path] = None, overrides: Iterable[str] = (), *, validate: bool = True) -> DictConfig:
    """Load, merge, type-check and (by default) validate an experiment config.

    Raises ConfigError listing every problem found, each naming its file or override and key.
    """
    layers: list[tuple[str, dict]] = []
    if path is not None:
        layers.extend(_load_chain(Path(path)))
    layers.extend(_parse_overrides(overrides))

    errors: list[str] = []
    for source, tree in layers:
        errors.extend(check_keys(tree, source))
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))

    cfg = OmegaConf.structured(ExperimentConfig)
    for source, tree in layers:
        try:
            cfg = OmegaConf.merge(cfg, tree)
        except OmegaConfBaseException as err:
            errors.append(_type_error(err, source))
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid config: cannot resolve an interpolation: {err}") from err
    if validate:
        from megarl.config.validate import validate_config

        validate_config(cfg)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
