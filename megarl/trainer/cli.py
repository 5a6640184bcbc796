"""`megarl train`: validate the config, prepare data and model, start Ray and the workers, run."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from megarl.config import critic_enabled, load_config, ref_enabled
from megarl.config.run_files import check_run_files
from megarl.config.rules import pool_size

if TYPE_CHECKING:
    from megarl.cluster.ray_cluster import StoppedBySignal

logger = logging.getLogger(__name__)


def ray_cpus_needed(cfg: DictConfig) -> int:
    """Logical CPUs a local Ray cluster needs: every pool's workers plus one for scoring tasks."""
    res = cfg.resources
    per_worker = float(res.num_cpus_per_worker)
    total = pool_size(res.actor_pool)
    if ref_enabled(cfg) and res.ref_pool is not None:
        total += pool_size(res.ref_pool)
    if critic_enabled(cfg) and res.critic_pool is not None:
        total += pool_size(res.critic_pool)
    if cfg.reward_model.enable and res.reward_model_pool is not None:
        total += pool_size(res.reward_model_pool)
    if res.rollout_pool is not None:
        total += pool_size(res.rollout_pool)
    return int(total * per_worker + 0.999) + 1


def generation_eos_token_ids(model_dir: str | Path) -> list[int]:
    """The `eos_token_id` of `model_dir/generation_config.json` (an int or a list) as a list; [] when
    the file is absent or names none. Chat models list their end-of-turn tokens there (Llama-3.1-8B-
    Instruct: [128001, 128008, 128009], Qwen2.5-Instruct: [151645, 151643]), and HF generation stops
    on any of them, while their tokenizers name only one EOS."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as err:
        logger.warning("%s: not read (%s); its eos_token_id does not end responses", path, err)
        return []
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        logger.warning("%s: eos_token_id %r is not an int or a list of ints; ignored", path, value)
        return []
    return [int(v) for v in values]


def eos_token_ids(tokenizer_eos: int | None, model_dirs: Iterable[str | Path], vocab_size: int | None = None
                  ) -> list[int]:
    """The ids that end a response: the tokenizer's EOS first, then the `generation_config.json`
    EOS ids of each directory in `model_dirs` (`generation_eos_token_ids`), without repeats. Ids
    outside the tokenizer's vocabulary (`vocab_size`, when given) are left out with a warning: such
    a file belongs to another tokenizer."""
    ids: list[int] = [] if tokenizer_eos is None else [int(tokenizer_eos)]
    for model_dir in model_dirs:
        for token in generation_eos_token_ids(model_dir):
            if vocab_size is not None and not 0 <= token < vocab_size:
                logger.warning("%s/generation_config.json: eos_token_id %d is outside the tokenizer's %d ids; "
                               "ignored", model_dir, token, vocab_size)
            elif token not in ids:
                ids.append(token)
    return ids


def stopped_during_start_up(cfg: DictConfig, stop: StoppedBySignal, resume_step: int | None) -> SystemExit:
    """The exit of a run that a signal stopped before its training loop began (Ray, the workers, the
    model and rollout engine starting): nothing of it was trained, so a rerun with
    trainer.resume_mode=auto loses nothing and `EXIT_STOPPED_FOR_RESUME` lets a launcher requeue it
    (launch/slurm/megarl.sbatch); with another resume mode, 128 + the signal as before."""
    from megarl.trainer.loop import EXIT_STOPPED_FOR_RESUME, TrainingStopped  # torch: as in train()

    name, step = stop.signal_name, resume_step or 0
    where = f"from its checkpoint of step {step}" if resume_step else "from the start"
    if cfg.trainer.resume_mode != "auto":
        logger.warning("stopped by %s while the run was starting (nothing trained); trainer.resume_mode=%s",
                       name, cfg.trainer.resume_mode)
        return TrainingStopped(int(stop.code), step)
    logger.warning("stopped by %s while the run was starting (nothing trained); exit status %d: a rerun with "
                   "trainer.resume_mode=auto (the default) starts again %s", name, EXIT_STOPPED_FOR_RESUME, where)
    return TrainingStopped(EXIT_STOPPED_FOR_RESUME, step)


def train(cfg: DictConfig) -> dict[str, float]:
    """Run one experiment; returns the last validation metrics. `cfg` must already be validated."""
    # Imported here, not at the top: `megarl config` and `megarl data` start without torch, Ray
    # and Megatron.
    from megarl.cluster.ray_cluster import StoppedBySignal, start_or_connect
    from megarl.trainer.loop import RLTrainer, TrainingStopped
    from megarl.trainer.run_spec import resolve_run_spec
    from megarl.trainer.setup import prepare_run
    from megarl.trainer.workers import start_workers
    from megarl.tracking.progress import Progress
    from megarl.tracking.report import write_report
    from megarl.tracking.tracker import Tracker

    run = prepare_run(cfg)  # data, tokenizer, model and rewards are checked before Ray starts
    # The model's own generation_config.json (model.path, or the directory the run built or linked
    # from it) adds its end-of-turn ids to the tokenizer's EOS.
    model_dirs = list(dict.fromkeys(str(d) for d in (run.model_dir, cfg.model.path) if d))
    eos = eos_token_ids(run.tokenizer.eos_token_id, model_dirs, vocab_size=len(run.tokenizer))
    if eos != [run.tokenizer.eos_token_id]:
        logger.info("responses end on EOS ids %s (tokenizer and generation_config.json)", eos)
    pad = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    spec = resolve_run_spec(cfg, str(run.model_dir), pad_token_id=pad, eos_token_ids=eos,
                            total_steps=run.total_steps)
    resume_step = run.resume[0] if run.resume else None
    res = cfg.resources
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Without a terminal the console backend already prints a line per step: the progress line
    # (step time, ETA) then comes every 10 steps.
    every = 10 if "console" in cfg.tracking.backends else 1
    progress = Progress(run.total_steps, start_step=resume_step or 0, enabled=cfg.trainer.progress_bar,
                        log_every=every)
    tracker = Tracker(
        run.run_dir, backends=list(cfg.tracking.backends), project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name, mlflow_tracking_uri=cfg.tracking.mlflow_tracking_uri,
        config=OmegaConf.to_container(cfg, resolve=True), resume_step=resume_step,
        console_write=progress.write, total_steps=run.total_steps,
        append_only=bool(cfg.trainer.val_only) and resume_step is not None,
    )
    status = "FAILED"
    training = False  # from here on the training loop takes SIGTERM (stop_on_signal)
    try:
        try:
            with start_or_connect(
                address=res.ray_address,
                num_cpus=res.ray_num_cpus or ray_cpus_needed(cfg),
                object_store_memory_gb=res.object_store_memory_gb,
            ) as cluster:
                workers = start_workers(cfg, spec)
                progress.write(f"rollout engine: {workers.rollout_engine}")
                try:
                    trainer = RLTrainer(run, spec, workers, tracker, progress)
                    training = True
                    last_val = trainer.fit(cluster.sigterm)
                except TrainingStopped:
                    status = "KILLED"  # stopped by a signal, with a checkpoint: mlflow's status for a run cut short
                    raise
                finally:
                    workers.shutdown()
        except StoppedBySignal as stop:
            if training:
                raise
            status = "KILLED"
            raise stopped_during_start_up(cfg, stop, resume_step) from None
        status = "FINISHED"
        return last_val
    finally:
        progress.close()
        tracker.close(status=status)
        run.reward_manager.close()
        if cfg.tracking.report_plots and (run.run_dir / "metrics.jsonl").is_file():
            try:
                paths = write_report(run.run_dir)
                logger.info("report: %s", ", ".join(str(p) for p in paths.values()))
            except Exception as err:  # a report must not hide the run's own outcome
                logger.warning("could not write the run report: %s", err)


def register_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="run an experiment (PPO, GRPO, DAPO, ...) from a YAML config")
    parser.add_argument("config", help="experiment YAML, e.g. configs/quickstart_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6 rollout.n=8")
    parser.set_defaults(func=_train_command)


def _train_command(args: Any) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)  # every config error before anything starts
    check_run_files(cfg)  # and every file problem, before torch, Ray and Megatron are imported
    metrics = train(cfg)
    if metrics:
        print("final validation: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
    return 0
