"""The files a run reads, checked before anything of the run is written and before Ray starts.

`megarl config validate` and `megarl train` (through `megarl.trainer.setup.prepare_run`) call the
same `check_run_files`, after the config itself validated: data files, tokenizer directory, user
reward function, and the model directories the roles start from (config.json, a supported
architecture, complete safetensors weights; see `model_files`). Every problem is reported at once,
each naming its key and path. The checks read file headers, not contents (the tokenizer and the
parquet rows are loaded later by the run itself), and import neither torch nor transformers, except
those of a reward model's or a critic's checkpoint, whose vocabulary is compared with the actor's
tokenizer (imported inside them, only for such a run).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from megarl.agent.tools import import_tool
from megarl.config.model_files import architecture_problem, model_dir_problems, read_hf_config
from megarl.config.rules import critic_enabled, model_hf_config
from megarl.errors import ConfigError

PARQUET_MAGIC = b"PAR1"
# Files of which a HF tokenizer directory has at least one (as megarl.data.tokenizer requires).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def parquet_problem(path: Path, key: str) -> Optional[str]:
    """Why `path` is not a readable parquet file (missing, a directory, no PAR1 magic at both ends)."""
    if not path.exists():
        return f"{key} = {str(path)!r}: no such file (`megarl data make` writes example datasets)"
    if not path.is_file():
        return f"{key} = {str(path)!r}: not a file (give parquet files, not a directory)"
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if size < 12 or head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
        return f"{key} = {str(path)!r}: not a parquet file ({size} bytes; no PAR1 marker at its start and end)"
    return None


def tokenizer_problem(cfg: DictConfig) -> Optional[str]:
    """Why the run's tokenizer directory (`data.tokenizer`, else `model.path`) cannot be loaded."""
    key = "data.tokenizer" if cfg.data.tokenizer else "model.path"
    path = cfg.data.tokenizer or cfg.model.path
    if not path:
        return "data.tokenizer: no tokenizer given (set data.tokenizer, or model.path to a directory holding one)"
    directory = Path(path)
    if not directory.is_dir():
        if key == "model.path":
            return None  # the model's own check reports the missing directory
        return f"{key} = {path!r}: no such directory (a HF tokenizer directory is expected)"
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        present = sorted(p.name for p in directory.iterdir())[:10]
        return (f"{key} = {path!r}: not a tokenizer directory, none of {list(TOKENIZER_FILES)} there "
                f"(present: {present})")
    return None


# Calls that can put any name into the module's namespace without a statement that spells it.
_DYNAMIC_BINDERS = frozenset({"globals", "exec", "setattr", "vars"})


def module_level_names(tree: ast.Module) -> tuple[set[str], list[str], Optional[str]]:
    """What the module's own namespace binds, outside function and class bodies: anywhere at module
    level, inside if/try/with/for/while/match blocks too (a def, class, import, assignment target
    including tuple and starred ones, for/with targets, `:=`). Returns (names, the functions among
    them, why other names may be there too: a star import, a module `__getattr__`, `globals()` ...;
    None when the names are all there is)."""
    names: set[str] = set()
    functions: list[str] = []
    dynamic: Optional[str] = None
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if not isinstance(node, ast.ClassDef):
                functions.append(node.name)
            stack.extend(node.decorator_list)  # evaluated at module level; the body is its own scope
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.comprehension):  # its target is local to the comprehension
            stack.extend([node.iter, *node.ifs])
            continue
        if isinstance(node, ast.AnnAssign) and node.value is None:  # `x: int` binds nothing
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    dynamic = dynamic or f"`from {node.module or '.'} import *` at line {node.lineno}"
                else:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _DYNAMIC_BINDERS):
            dynamic = dynamic or f"`{node.func.id}(...)` at line {node.lineno}"
        stack.extend(ast.iter_child_nodes(node))
    if "__getattr__" in names:  # PEP 562: the module answers any attribute lookup
        dynamic = dynamic or "a module-level `__getattr__`"
    return names, sorted(set(functions)), dynamic


def reward_function_problem(path: Optional[str], name: str) -> Optional[str]:
    """Why `reward.custom_reward_function` cannot be loaded: the file is missing, is not Python, or
    binds `name` nowhere at module level (see `module_level_names`). A module that may bind names no
    statement spells (a star import, `globals()`, a module `__getattr__`) is given the benefit of
    the doubt: the scoring worker reports a missing name when it loads the file."""
    if not path:
        return None
    file = Path(path)
    if not file.is_file():
        return f"reward.custom_reward_function.path = {path!r}: no such file"
    try:
        tree = ast.parse(file.read_text(), filename=str(file))
    except (SyntaxError, UnicodeDecodeError, ValueError) as err:
        return f"reward.custom_reward_function.path = {path!r}: not valid Python ({err})"
    names, functions, dynamic = module_level_names(tree)
    if name in names or dynamic:
        return None
    return (f"reward.custom_reward_function.name = {name!r}: {path} defines no such top-level function "
            f"(functions there: {functions})")


def model_problems(cfg: DictConfig) -> list[str]:
    """The actor's model (`model.*`) and the critic's starting point (`critic.model_path`)."""
    model = cfg.model
    problems: list[str] = []
    if model.path and not model.init_from_scratch:
        problems += model_dir_problems(Path(model.path), "model.path", need_weights=True, family=model.spec)
        if not problems and model.override_config:  # the workers see the checkpoint's config through it
            try:
                hf = model_hf_config(cfg) or {}
            except ConfigError as err:
                return [str(err)]
            arch = architecture_problem(
                hf, f"model.override_config over model.path: {Path(model.path) / 'config.json'}", model.spec)
            if arch:
                problems.append(arch)
    else:
        if model.path:  # random init over the directory's config.json
            _, problems = read_hf_config(Path(model.path), "model.path")
        if not problems:
            try:
                hf = model_hf_config(cfg) or {}
            except ConfigError as err:
                return [str(err)]
            inline = "model_type" in model.hf_config or "model_type" in model.override_config
            where = "model.hf_config" if inline or not model.path else f"model.path: {Path(model.path) / 'config.json'}"
            arch = architecture_problem(hf, where, model.spec)
            if arch:
                problems.append(arch)
    if critic_enabled(cfg) and cfg.critic.model_path:
        problems += model_dir_problems(Path(cfg.critic.model_path), "critic.model_path", need_weights=True,
                                       family=model.spec)
    return problems


def run_file_problems(cfg: DictConfig) -> list[str]:
    """Every problem with the files the run `cfg` reads ([] when none). `cfg` must have validated."""
    problems: list[str] = []
    for section in ("train_files", "val_files"):
        for i, path in enumerate(cfg.data[section]):
            problem = parquet_problem(Path(path), f"data.{section}[{i}]")
            if problem:
                problems.append(problem)
    tokenizer = tokenizer_problem(cfg)
    for problem in (tokenizer, reward_function_problem(cfg.reward.custom_reward_function.path,
                                                       cfg.reward.custom_reward_function.name)):
        if problem:
            problems.append(problem)
    problems += model_problems(cfg)
    problems += tool_problems(cfg)
    if tokenizer is None and cfg.reward_model.enable and cfg.reward_model.model_path:
        problems += reward_model_checkpoint_problems(cfg)
    if tokenizer is None and critic_enabled(cfg) and cfg.critic.model_path:
        problems += critic_vocabulary_problems(cfg)
    return problems


def tool_problems(cfg: DictConfig) -> list[str]:
    """`rollout.multi_turn.tools` given as "package.module:ClassName": imported here, as the rollout
    workers will, so that a missing module or class is named before they start."""
    if not cfg.rollout.multi_turn.enable:
        return []
    problems = []
    for i, name in enumerate(cfg.rollout.multi_turn.tools):
        if ":" in str(name):
            try:
                import_tool(str(name))
            except ValueError as err:
                problems.append(f"rollout.multi_turn.tools[{i}]: {err}")
    return problems


def reward_model_checkpoint_problems(cfg: DictConfig) -> list[str]:
    """`reward_model.model_path`: score head, one label, a vocabulary that covers the tokenizer
    (checked when the tokenizer loads: it is compared with the reward model's)."""
    # Imported here: transformers and torch, which `megarl config` starts without.
    from megarl.rewards.model_checkpoint import reward_model_problems

    return list(reward_model_problems(str(cfg.reward_model.model_path), cfg.data.tokenizer or cfg.model.path or None))


def critic_vocabulary_problems(cfg: DictConfig) -> list[str]:
    """`critic.model_path` against the actor's tokenizer. The critic reads the batch's token ids as the
    actor's tokenizer made them (the reward model has the text re-tokenised when its vocabulary
    differs; the critic has no such path): a tokenizer of its own must be the actor's vocabulary (the
    same comparison decides the reward model's re-tokenising), and its embedding must cover every id
    of the actor's tokenizer, else it would value other tokens than the actor sampled, or fail on
    ids past its embedding."""
    # Imported here: transformers and torch, which `megarl config` starts without.
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rewards.model_checkpoint import has_own_tokenizer
    from megarl.rewards.model_scores import same_vocabulary

    model_dir = Path(cfg.critic.model_path)
    config, _ = read_hf_config(model_dir, "critic.model_path")
    actor_dir = cfg.data.tokenizer or cfg.model.path
    if config is None or not Path(actor_dir).is_dir():  # model_problems / tokenizer_problem name these
        return []
    try:
        actor = load_tokenizer(actor_dir)
    except ConfigError as err:  # it names the directory
        return [str(err)]
    why = ("the critic reads the actor's token ids (unlike the reward model, whose input is re-tokenised "
           "with its own tokenizer)")
    problems = []
    if has_own_tokenizer(model_dir):
        try:
            own = load_tokenizer(model_dir)
        except ConfigError as err:
            return [f"critic.model_path = {str(model_dir)!r}: {err}"]
        if not same_vocabulary(actor, own):
            file = next(model_dir / name for name in TOKENIZER_FILES if (model_dir / name).is_file())
            problems.append(f"critic.model_path = {str(model_dir)!r}: its tokenizer ({file}) maps tokens to other ids "
                            f"than the actor's ({actor_dir}); {why}, so it would value other tokens than the actor "
                            "sampled. Start the critic from a checkpoint of the actor's vocabulary")
    vocab = config.get("vocab_size")
    if vocab is not None and int(vocab) < len(actor):
        problems.append(f"critic.model_path: {model_dir / 'config.json'}: vocab_size = {vocab}, but the actor's "
                        f"tokenizer ({actor_dir}) has {len(actor)} token ids; {why}, so its embedding must cover "
                        "every one")
    return problems


def check_run_files(cfg: DictConfig) -> None:
    """Raise ConfigError listing every problem with the files the run reads."""
    problems = run_file_problems(cfg)
    if problems:
        raise ConfigError("the run cannot start:\n  " + "\n  ".join(problems))
