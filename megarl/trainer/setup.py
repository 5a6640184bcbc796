"""What the driver prepares before any worker starts: run directory, tokenizer, model, data, rewards."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM

from megarl.agent.chat import ToolTurnEncoder
from megarl.agent.tools import ToolSet
from megarl.config.model_files import weights_problems
from megarl.config.run_files import check_run_files
from megarl.data.dataset import RLDataset
from megarl.data.loader import RLDataLoader
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import CheckpointError, ConfigError
from megarl.megatron.checkpoint_format import OPTIMIZER_KINDS, configured_optimizer_kind, saved_optimizer_kind
from megarl.protocol import Batch
from megarl.rewards.manager import RewardManager
from megarl.trainer.checkpoint_dirs import STATE_FILE, CheckpointDirs
from megarl.trainer.resume import select_resume
from megarl.trainer.run_spec import response_length

logger = logging.getLogger(__name__)
MODEL_READY = "MEGARL_MODEL_READY"


@dataclass
class RunContext:
    cfg: DictConfig
    run_dir: Path
    model_dir: Path  # HF directory every role loads its initial weights from
    tokenizer: Any
    train_loader: Any
    val_dataset: Optional[Any]
    reward_manager: Any
    total_steps: int
    resume: Optional[tuple[int, Path]] = None  # the verified checkpoint (step, dir) the run resumes from
    probe_prompts: Optional[Batch] = None  # rollout.probe_freq > 0: the prompts of the weight-sync probe


def _config_digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class InitialModelPlan:
    """The random-init model a run builds: its HF config (with the tokenizer's vocabulary) and the
    digest that `MODEL_READY` holds once it is saved."""

    model_type: str
    hf: dict[str, Any]
    digest: str


def initial_model_plan(cfg: DictConfig, tokenizer: Any) -> Optional[InitialModelPlan]:
    """The model `materialize_model` builds, or None when `model.path` is used as it is."""
    if cfg.model.path and not cfg.model.init_from_scratch:
        return None
    hf: dict[str, Any] = {}
    if cfg.model.path:
        hf.update(json.loads((Path(cfg.model.path) / "config.json").read_text()))
    hf.update(OmegaConf.to_container(cfg.model.hf_config, resolve=True))
    hf.update(OmegaConf.to_container(cfg.model.override_config, resolve=True))
    model_type = hf.pop("model_type", None)
    if not model_type:
        raise ConfigError("model.hf_config.model_type is required to build a model from a config (e.g. qwen2, llama)")
    vocab = len(tokenizer)
    hf["vocab_size"] = max(int(hf.get("vocab_size") or 0), vocab)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None and key not in hf:
            hf[key] = value
    hf.setdefault("torch_dtype", "float32")
    digest = _config_digest({"model_type": model_type, "hf": hf, "seed": int(cfg.trainer.seed)})
    return InitialModelPlan(model_type, hf, digest)


def check_initial_model_kept(cfg: DictConfig, tokenizer: Any, out_dir: Path, checkpoint: Path) -> None:
    """A resumed run must find the initial model it was started with (the reference and the roles
    not in the checkpoint load it): refuse, before anything is written, a config that would build
    another one (a changed tokenizer vocabulary, model config or `trainer.seed`), or damaged weights."""
    plan = initial_model_plan(cfg, tokenizer)
    marker = out_dir / MODEL_READY
    if plan is None or not marker.is_file():
        return
    if marker.read_text().strip() == plan.digest:
        damaged = weights_problems(out_dir, "initial model")
        if damaged:
            raise ConfigError(f"cannot resume {checkpoint}: {'; '.join(damaged)}; nothing was written. Remove {out_dir} "
                              "to rebuild it (the same config and trainer.seed give the same weights)")
        return
    on_disk_file = out_dir / "config.json"
    on_disk = json.loads(on_disk_file.read_text()) if on_disk_file.is_file() else {}
    wanted = {"model_type": plan.model_type, **plan.hf}
    differ = [f"{k}: {on_disk[k]!r} there, {v!r} now" for k, v in sorted(wanted.items())
              if k in on_disk and on_disk[k] != v and k != "torch_dtype"]
    earlier = checkpoint / "config.yaml"
    if earlier.is_file():
        seed = OmegaConf.load(earlier).get("trainer", {}).get("seed")
        if seed is not None and int(seed) != int(cfg.trainer.seed):
            differ.append(f"trainer.seed: {seed} in the checkpoint's run, {cfg.trainer.seed} now")
    raise ConfigError(
        f"cannot resume {checkpoint}: this run would build another initial model than {out_dir} "
        f"({'; '.join(differ[:6]) or 'its config digest differs'}); nothing was written. Resume with the same "
        "model, tokenizer (data.tokenizer) and trainer.seed, or start in another trainer.default_local_dir"
    )


def materialize_model(cfg: DictConfig, tokenizer: Any, out_dir: Path) -> Path:
    """A HF model directory for the run's initial weights.

    `model.path` without `init_from_scratch` is used as it is (seen through `model.override_config`,
    see `with_config_overrides`). Otherwise a model is built from
    `model.hf_config` (over `model.path`'s config.json, if given) with the vocabulary of the
    tokenizer, initialised with `trainer.seed`, and saved once under the run directory; a resumed
    run finds it there (same config digest) and does not rebuild it.
    """
    plan = initial_model_plan(cfg, tokenizer)
    if plan is None:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path = {str(path)!r}: no config.json there")
        overrides = OmegaConf.to_container(cfg.model.override_config, resolve=True)
        return with_config_overrides(path, overrides, out_dir) if overrides else path
    model_type, hf, digest = plan.model_type, plan.hf, plan.digest
    marker = out_dir / MODEL_READY
    if marker.is_file() and marker.read_text().strip() == digest:
        return out_dir
    config = AutoConfig.for_model(model_type, **hf)
    torch.manual_seed(int(cfg.trainer.seed))
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    marker.write_text(digest)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("initial model: %s, %.2fM parameters, random init (seed %d) -> %s", model_type, n_params / 1e6,
                int(cfg.trainer.seed), out_dir)
    return out_dir


def with_config_overrides(model_path: Path, overrides: dict[str, Any], out_dir: Path) -> Path:
    """`model_path` seen through `model.override_config`: `out_dir` gets config.json with the
    overrides applied and a link to every other file (weights are not copied)."""
    config = json.loads((model_path / "config.json").read_text())
    config.update(overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    for entry in model_path.iterdir():
        link = out_dir / entry.name
        if entry.name != "config.json" and not link.exists():
            link.symlink_to(entry.resolve())
    text = json.dumps(config, indent=2, sort_keys=True)
    target = out_dir / "config.json"
    if not target.is_file() or target.read_text() != text:  # a resumed run finds it as it was
        tmp = out_dir / "config.json.tmp"
        tmp.write_text(text)
        tmp.replace(target)
    logger.info("model: %s with override_config %s -> %s", model_path, sorted(overrides), out_dir)
    return out_dir


def load_run_tokenizer(cfg: DictConfig) -> Any:
    path = cfg.data.tokenizer or cfg.model.path
    if not path:
        raise ConfigError("data.tokenizer: no tokenizer given (set data.tokenizer or model.path)")
    return load_tokenizer(path)


def build_datasets(cfg: DictConfig, tokenizer: Any) -> tuple[Any, Optional[Any]]:
    data = cfg.data
    common = dict(
        prompt_key=data.prompt_key,
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts,
        skip_bad_rows=data.skip_bad_rows,
        apply_chat_template=data.apply_chat_template,
        chat_template_kwargs=OmegaConf.to_container(data.apply_chat_template_kwargs, resolve=True),
        # With a reward model, rows of reward_model.style "model" are its to judge.
        model_scored_rows=bool(cfg.reward_model.enable),
        # With tools, each row's extra_info.tools_kwargs is checked against them when the data is
        # opened: by the name each tool gives itself (a "pkg.mod:Class" tool's differs from its config string).
        tools=(sorted(ToolSet.from_names(list(cfg.rollout.multi_turn.tools)).tools)
               if cfg.rollout.multi_turn.enable else None),
    )
    train = RLDataset(list(data.train_files), tokenizer, **common)
    if len(train) < data.train_batch_size:
        raise ConfigError(
            f"data.train_files hold {len(train)} usable prompts, fewer than data.train_batch_size = {data.train_batch_size}"
        )
    # With DAPO dynamic sampling each generation round takes `gen_batch_size` prompts.
    round_size = data.gen_batch_size if cfg.algorithm.filter_groups.enable and data.gen_batch_size else data.train_batch_size
    if len(train) < round_size:
        raise ConfigError(
            f"data.train_files ({', '.join(map(str, data.train_files))}) hold {len(train)} usable prompts, fewer than "
            f"data.gen_batch_size = {round_size}, the prompts of one generation round of DAPO dynamic sampling "
            f"(algorithm.filter_groups.enable); set data.gen_batch_size to at most {len(train)} (and at least "
            f"data.train_batch_size = {data.train_batch_size}) or add training data"
        )
    loader = RLDataLoader(train, round_size, shuffle=data.shuffle, seed=data.seed)
    val = RLDataset(list(data.val_files), tokenizer, **common) if data.val_files else None
    return loader, val


def total_training_steps(cfg: DictConfig, batches_per_epoch: int) -> int:
    if cfg.trainer.total_training_steps:
        return int(cfg.trainer.total_training_steps)
    return int(batches_per_epoch * cfg.trainer.total_epochs)


def probe_prompts(cfg: DictConfig, dataset: RLDataset) -> Optional[Batch]:
    """The fixed prompts of the weight-sync probe (`rollout.probe_freq`): the first
    `rollout.probe_prompts` rows of the training data, whatever the shuffling; None without a probe."""
    if not cfg.rollout.probe_freq:
        return None
    wanted = int(cfg.rollout.probe_prompts)
    if wanted > len(dataset):
        raise ConfigError(f"rollout.probe_prompts = {wanted}: the training data ({', '.join(map(str, cfg.data.train_files))}) "
                          f"has only {len(dataset)} prompts; valid: 1 to {len(dataset)}")
    rows = dataset.get_rows(list(range(wanted)))
    return dataset.collate(rows, uids=[f"probe-{e['row']}" for e in rows])


def check_reward_model_rows(cfg: DictConfig, dataset: RLDataset) -> None:
    """With `reward_model.combine: by_style` only rows of style "model" take the reward model's
    score: training data without any would compute it for every row and use it for none."""
    rm = cfg.reward_model
    if rm.enable and rm.combine == "by_style" and not dataset.has_model_scored_rows():
        raise ConfigError(
            f"reward_model.enable with reward_model.combine = 'by_style': no row of data.train_files "
            f"({', '.join(map(str, cfg.data.train_files))}) has reward_model.style 'model', so every row would be "
            "scored by rule and the reward model's scores used for none; mark the rows it judges "
            "(reward_model: {style: model}) or set reward_model.combine: weighted_sum"
        )


# What decides each part of the sampler's layout: what to restore when a resume finds it changed.
_SAMPLER_SOURCES = {
    "num_rows": "the usable prompts of data.train_files, after data.filter_overlong_prompts and data.skip_bad_rows",
    "batch_size": "data.train_batch_size, or data.gen_batch_size with algorithm.filter_groups.enable",
    "shuffle": "data.shuffle",
    "seed": "data.seed",
    "drop_last": "fixed by megarl",
}


def check_data_kept(checkpoint: Path, loader: RLDataLoader) -> None:
    """A resumed run continues the checkpoint's sequence of batches: refuse, before anything is
    written, training data or data settings that give the sampler another layout (rows, batch size,
    shuffle, seed) than the checkpoint's `trainer_state.pt` holds. `RLTrainer.fit` checks it again
    when it loads the state, but only once the run directory is written and the workers run."""
    state_file = checkpoint / STATE_FILE
    state = torch.load(state_file, map_location="cpu", weights_only=False)  # the run's own file, verified
    saved = state.get("dataloader", {}).get("sampler") if isinstance(state, dict) else None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{state_file}: no dataloader.sampler state; resume from another checkpoint")
    differ = [f"{key}: {repr(saved[key]) if key in saved else 'absent'} in the checkpoint, "
              f"{getattr(loader.sampler, key)!r} now ({_SAMPLER_SOURCES[key]})"
              for key in loader.sampler.layout_differences(saved)]
    if differ:
        raise ConfigError(
            f"cannot resume {checkpoint}: this run's training data would not continue its sequence of batches "
            f"({'; '.join(differ)}; from {state_file}); nothing was written. Resume with the data and data "
            "settings the checkpoint was trained with, or train on this data as a new run: "
            "trainer.resume_mode=disable in another trainer.default_local_dir (to start from the checkpoint's "
            f"weights: megarl convert mcore-to-hf --ckpt {checkpoint / 'actor'} --out DIR, then model.path=DIR)"
        )


def check_optimizer_kept(cfg: DictConfig, checkpoint: Path) -> None:
    """A trained engine resumes only into an optimizer of the kind it was saved with (their state
    tensors differ): refuse, before anything is written, a `use_distributed_optimizer` or
    `model.dtype` that makes another kind than the checkpoint's `common.pt` records. The engine
    refuses it too when it loads, but only once the workers run."""
    for engine, optim_key in (("actor", "actor.optim"), ("critic", "critic.optim")):
        common_file = checkpoint / engine / "common.pt"
        if not common_file.is_file():
            continue
        common = torch.load(common_file, map_location="cpu", weights_only=False) or {}  # the run's own, verified
        saved = saved_optimizer_kind(common)
        optim = OmegaConf.select(cfg, optim_key)
        wanted = configured_optimizer_kind(bool(optim.use_distributed_optimizer), str(cfg.model.dtype))
        if saved is not None and saved != wanted:
            raise ConfigError(
                f"cannot resume {checkpoint}: its {engine} was saved with {OPTIMIZER_KINDS.get(saved, saved)}, this "
                f"run would build {OPTIMIZER_KINDS[wanted]} ({optim_key}.use_distributed_optimizer = "
                f"{bool(optim.use_distributed_optimizer)}, model.dtype = {cfg.model.dtype!r}), whose state "
                f"holds other tensors; nothing was written. Resume with the checkpoint's settings (from "
                f"{common_file})")


def prepare_run(cfg: DictConfig) -> RunContext:
    """Everything the driver needs before starting workers; fails on bad data before Ray starts.

    Nothing of the run directory is written (initial model, config.yaml) before every check passed:
    the files the run reads (`check_run_files`, as `megarl config validate` does), the data, the
    rewards, and for a resumed run its checkpoint, model keys, data-loader layout and initial model.
    """
    check_run_files(cfg)
    run_dir = Path(cfg.trainer.default_local_dir).absolute()
    tokenizer = load_run_tokenizer(cfg)
    if cfg.rollout.multi_turn.enable:  # a chat template that cannot render tool turns: refused now, not at a tool call
        ToolTurnEncoder(tokenizer, OmegaConf.to_container(cfg.data.apply_chat_template_kwargs, resolve=True))
    train_loader, val_dataset = build_datasets(cfg, tokenizer)
    reward_manager = RewardManager.from_config(cfg.reward, response_length(cfg))
    reward_manager.check_data_sources(train_loader.dataset.rule_data_sources())
    check_reward_model_rows(cfg, train_loader.dataset)
    probe = probe_prompts(cfg, train_loader.dataset)
    if val_dataset is not None:
        reward_manager.check_data_sources(val_dataset.rule_data_sources())
    # Verified before the run directory is written to (initial model, config) and before Ray starts.
    resume = select_resume(CheckpointDirs(run_dir / "checkpoints"), run_dir, cfg.trainer.resume_mode,
                           cfg.trainer.resume_from_path, bool(cfg.trainer.resume_fallback),
                           model=OmegaConf.to_container(cfg.model, resolve=True))
    if resume is not None:  # first: other data also changes the number of steps checked next
        check_data_kept(resume[1], train_loader)
        check_optimizer_kept(cfg, resume[1])
    total_steps = total_training_steps(cfg, len(train_loader))
    if resume is not None:
        if resume[0] > total_steps:
            raise ConfigError(
                f"{resume[1]}: the checkpoint to resume from is at step {resume[0]}, past the run's last step "
                f"{total_steps} (trainer.total_training_steps = {cfg.trainer.total_training_steps}, "
                f"trainer.total_epochs = {cfg.trainer.total_epochs}); set trainer.total_training_steps above "
                f"{resume[0]} to train on, or start another run (trainer.default_local_dir, or "
                "trainer.resume_mode=disable with an empty directory)")
        check_initial_model_kept(cfg, tokenizer, run_dir / "initial_model", resume[1])
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = materialize_model(cfg, tokenizer, run_dir / "initial_model")
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return RunContext(
        cfg=cfg,
        run_dir=run_dir,
        model_dir=model_dir,
        tokenizer=tokenizer,
        train_loader=train_loader,
        val_dataset=val_dataset,
        reward_manager=reward_manager,
        total_steps=total_steps,
        resume=resume,
        probe_prompts=probe,
    )
