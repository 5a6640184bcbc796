"""Checks of a reward-model checkpoint (`reward_model.model_path`) before any worker starts.

A reward model is a HF sequence-classification directory with one label: its `score` head, of
shape (1, hidden), is the engine's scalar head, and its score is the head at the last valid token.
The same model converted by `megarl convert hf-to-mcore` (a Megatron checkpoint whose `hf/` folder
keeps the config and tokenizer) is accepted too. Every problem is reported with the file it was
found in and what was expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from megarl.convert import MEGATRON_MARKER
from megarl.convert.dcp_io import CheckpointReader
from megarl.convert.hf_files import HFCheckpoint
from megarl.convert.hf_to_mcore import HF_FILES_DIR, VALUE_HEAD
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import MegarlError
from megarl.models.spec import ModelSpec

MEGATRON_HEAD = "output_layer.weight"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def is_converted(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a Megatron distributed checkpoint (e.g. from `megarl convert`)."""
    return (Path(model_dir) / MEGATRON_MARKER).is_file()


def hf_files_dir(model_dir: str | Path) -> Path:
    """Where the reward model's config.json and tokenizer are: the directory itself, or the `hf/`
    folder of a converted checkpoint."""
    return Path(model_dir) / HF_FILES_DIR if is_converted(model_dir) else Path(model_dir)


def reward_model_spec(model_dir: str | Path, family: Optional[str] = None) -> ModelSpec:
    """The model spec the reward-model role builds its engine from: of the family a converted
    checkpoint records (its weights are laid out by that family's weight map, which `--spec` may
    have named for a model_type no family lists), else of `family` (None: the family listing the
    config's model_type)."""
    recorded = None
    if is_converted(model_dir):
        recorded = (CheckpointReader(model_dir).common().get("megarl") or {}).get("family")
    return ModelSpec.from_hf_config(str(hf_files_dir(model_dir)), family=recorded or family)


def has_own_tokenizer(model_dir: str | Path) -> bool:
    """Whether the reward model carries a tokenizer of its own."""
    return any((hf_files_dir(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def _head_shape(root: Path) -> tuple[Optional[tuple[int, ...]], str, Optional[str]]:
    """(shape of the score head or None, the file it is in, a problem reading the weights or None)."""
    try:
        if is_converted(root):
            reader = CheckpointReader(root)
            size = reader.metadata.state_dict_metadata.get(MEGATRON_HEAD)
            role = (reader.common().get("megarl") or {}).get("role")
            if role == "policy":  # its output layer is the LM head, not a score head
                return None, str(root), None
            return (tuple(size.size) if size is not None else None), str(root), None
        weights = HFCheckpoint(root)
    except MegarlError as err:
        return None, str(root), str(err)
    head = weights.tensors.get(VALUE_HEAD)
    return (head.shape if head is not None else None), str(root / head.file) if head else str(root), None


def num_labels(config: dict[str, Any]) -> int:
    """Labels of a HF config: `num_labels` when written, else the size of `id2label` (transformers
    writes only the latter), else transformers' default of 2."""
    if "num_labels" in config:
        return int(config["num_labels"])
    if config.get("id2label"):
        return len(config["id2label"])
    return 2


def reward_model_problems(model_dir: str, actor_tokenizer_dir: Optional[str],
                          family: Optional[str] = None) -> list[str]:
    """What is wrong with the reward model in `model_dir` ([] when nothing).

    The tokenizer whose ids reach the model is its own when the directory has one, else the actor's
    (`actor_tokenizer_dir`; None skips the vocabulary check): its ids must fit the embedding. The
    model spec is built as the reward-model role builds it (`reward_model_spec`, `family` being the
    role's), so that a config no family maps fails here, before any worker starts.
    """
    root = Path(model_dir)
    config_file = hf_files_dir(root) / "config.json"
    if not config_file.is_file():
        return [f"reward_model.model_path = {model_dir!r}: no config.json there (a HF sequence-classification "
                "directory is expected)"]
    try:
        config = json.loads(config_file.read_text())
    except ValueError as err:
        return [f"{config_file}: not valid JSON ({err})"]
    problems = []
    try:
        reward_model_spec(root, family)
    except MegarlError as err:
        problems.append(f"reward_model.model_path = {model_dir!r}: {err}")
    arch = (config.get("architectures") or [None])[0]
    if not (arch or "").endswith("ForSequenceClassification"):
        problems.append(f"{config_file}: architectures = {config.get('architectures')}; a reward model is a "
                        "<Family>ForSequenceClassification checkpoint (e.g. Qwen2ForSequenceClassification)")
    labels = num_labels(config)
    if labels != 1:
        problems.append(f"{config_file}: the model has {labels} labels; a reward model has num_labels = 1 "
                        "(one score per sequence)")
    hidden = config.get("hidden_size")
    shape, where, unreadable = _head_shape(root)
    name = MEGATRON_HEAD if is_converted(root) else VALUE_HEAD
    if unreadable is not None:
        problems.append(unreadable)
        return problems
    if shape is None:
        problems.append(f"{where}: no '{name}' score head in its weights; a reward model needs one, of shape "
                        f"[1, hidden_size = {hidden}]")
    elif hidden is not None and tuple(shape) != (1, int(hidden)):
        problems.append(f"{where}: '{name}' has shape {list(shape)}; a reward model's head is "
                        f"[1, hidden_size = {hidden}]")
    vocab = config.get("vocab_size")
    tokenizer_dir = str(hf_files_dir(root)) if has_own_tokenizer(root) else actor_tokenizer_dir
    tokenizer_vocab = None
    if tokenizer_dir is not None:
        try:
            tokenizer_vocab = len(load_tokenizer(tokenizer_dir))
        except MegarlError as err:
            problems.append(str(err))
    if tokenizer_vocab is not None and vocab is not None and tokenizer_vocab > int(vocab):
        source = "its own tokenizer" if has_own_tokenizer(root) else "the actor's tokenizer (it has none of its own)"
        problems.append(f"{config_file}: vocab_size = {vocab}, but {source} has {tokenizer_vocab} token ids; "
                        "the embedding must cover every id (give the reward model its own tokenizer)")
    return problems
