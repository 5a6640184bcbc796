"""The driver loop of PPO, GRPO, DAPO and their relatives: one file, read top to bottom.

One step (see `RLTrainer.train_step`):
  1. prompts <- the data loader (left-padded, a `uid` per prompt)
  2. responses <- rollout (weights synced from the actor first), n per prompt; then the rollout
     engine sleeps (`rollout.free_cache_engine`) so the training roles get the memory (and, before
     it scores, a reward model in the engine's processes)
  3. scores <- the reward manager (rule scorers or a user function; DAPO overlong shaping) and the
     reward model (`reward_model.enable`), each row judged as its `reward_model.style` says
     DAPO: drop groups whose responses all score the same; generate more until the batch is full
     (without the group filter and the reward model, the driver scores while the workers run the
     first pass of step 4 instead: `reward.overlap`)
  4. old log-probs (an actor pass; or, without it, the update's own or the rollout's:
     `actor.old_log_prob_source`), reference log-probs, values (critic); first the rows are
     reordered so each actor DP rank gets about the same tokens (`trainer.balance_batch`). When the
     actor's pass is the only one and the update leaves out the rows of zero advantage
     (`actor.skip_zero_advantage_rows`), it runs after step 5, on the rows the update runs
  5. advantages on the driver's CPU (KL in the reward first when configured)
  6. critic update, then actor update (after the critic warm-up); in sync mode the next step's
     weight sync and generation are sent right behind the update (`trainer.queue_generation`)
  7. metrics, validation every `test_freq` steps, checkpoint every `save_freq` steps (both also
     at the last step)

SIGTERM (SLURM before the time limit, Kubernetes, `kill`) stops the run at the next step boundary
(before the first step, or after the step running, its validation and checkpoint): a checkpoint of
that step is written unless one just was, the metrics are flushed, and `megarl train` exits with
`EXIT_STOPPED_FOR_RESUME` (75), after which a rerun with `trainer.resume_mode=auto` continues.

Memory phases are lines of this file: a role whose `*_offload` keys are set is onloaded right
before the phase that computes with it (`self.onloaded(...)`: its parameters only for a forward pass
or a weight sync, everything for an update) and offloaded right after; the rollout
engine sleeps once a step's generation is done (`self.rollout_sleep()`; with a reward model in its
processes before that model scores, so each of DAPO's rounds and each validation batch sleeps
before its scoring and the next generation wakes it) and wakes its weights first, then its KV
cache, around the next weight sync. Each step's transitions (with those of the
validation after it, phase "val") are written to `<run>/memory_phases.jsonl`, and the memory peak of every phase that ran on the workers is logged
as `memory/<phase>/...` (the driver-only phases, reward and adv, have none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional

import numpy as np
import torch

from megarl.agent.rollout import agent_metrics
from megarl.algorithms import (
    AdvantageInputs,
    AdvantageSettings,
    DynamicSamplingState,
    apply_kl_penalty,
    check_logprob_gap,
    filter_groups,
    get_advantage_estimator,
    logprob_gap,
    make_kl_controller,
    rollout_mismatch_metrics,
    rows_with_advantage,
    rows_with_advantage_or_one,
    sequence_metric,
)
from megarl.cluster.dispatch import plan_dispatch
from megarl.cluster.host_worker import HostWorker
from megarl.cluster.ray_cluster import StopRequest, stop_on_signal
from megarl.cluster.remote_call import CallHandle, gather
from megarl.cluster.rendezvous import address_and_free_port
from megarl.cluster.worker_group import RoleView, WorkerGroup
from megarl.protocol import Batch
from megarl.protocol.balance import balance_applies, balance_order
from megarl.rewards.manager import with_common_reward_info
from megarl.rewards.model_scores import combine_scores, reward_model_inputs, reward_model_tokenizer, row_styles
from megarl.rollout.base import SamplingParams
from megarl.rollout.partial import OPEN, TOKEN_VERSIONS, WeightSignal, oldest_versions, open_rows, partial_metrics
from megarl.trainer.checkpoint_dirs import CheckpointDirs, capture_rng_state, restore_rng_state
from megarl.trainer.checkpointing import TrainerCheckpointer, check_driver_state_restored
from megarl.trainer.rollout_dump import dump_rollouts, dump_validation
from megarl.trainer.run_spec import RunSpec, with_seed
from megarl.trainer.setup import RunContext
from megarl.trainer.timing import Timer
from megarl.trainer.validation import validate, validation_batches
from megarl.trainer.workers import Workers
from megarl.tracking.jsonl import keep_steps_up_to
from megarl.tracking.memory import phase_metrics as memory_phase_metrics
from megarl.tracking.memory import step_metrics as memory_step_metrics
from megarl.tracking.metrics import compute_data_metrics, compute_throughput, compute_timing_metrics, count_tokens
from megarl.tracking.plots import OUTSIDE_STEP_PHASES
from megarl.workers.losses import OLD_LOG_PROB_SOURCES
from megarl.workers.roles import ROLLOUT_BUSY, ActorRole, CriticRole, EngineRole, RefRole, RewardModelRole, RolloutRole
from megarl.workers.specs import EngineRoleSpec

logger = logging.getLogger(__name__)


def merge_round_metrics(before: dict[str, float], rows_before: int, new: dict[str, float],
                        rows: int) -> dict[str, float]:
    """Scoring metrics of several rounds of one step (DAPO's generation batches) as one: counts,
    bytes and seconds summed, extremes taken, means weighted by the rows each round scored."""
    merged = {}
    for key, value in new.items():
        if key not in before:
            merged[key] = value
        elif key.startswith(("reward/num_", "reward/worker_")) or key == "reward/time_s":
            merged[key] = before[key] + value
        elif key.endswith("/max"):
            merged[key] = max(before[key], value)
        elif key.endswith("/min"):
            merged[key] = min(before[key], value)
        else:
            merged[key] = (before[key] * rows_before + value * rows) / (rows_before + rows)
    return merged


def run_devices(resources: Any) -> int:
    """Devices of every pool in `resources` (the actor's, and each other pool that is set)."""
    pools = [resources.actor_pool] + [getattr(resources, name) for name in OTHER_POOLS]
    return int(sum(pool.nnodes * pool.devices_per_node for pool in pools if pool is not None))


OTHER_POOLS = ("critic_pool", "ref_pool", "reward_model_pool", "rollout_pool")


def estimated_last_step(step: int, batches_used: int, batches_total: int) -> int:
    """The last step of a run that ends with its data, from the loader batches its `step` steps have
    taken so far (DAPO's dynamic sampling takes one or more a step): the remaining batches at the
    mean rate so far."""
    per_step = batches_used / max(step, 1)
    return step + math.ceil(max(batches_total - batches_used, 0) / max(per_step, 1e-9))


def longest_timeout(*timeouts: float | None) -> float | None:
    """The longest of several groups' call timeouts (None, no timeout, is the longest)."""
    return None if any(t is None for t in timeouts) else max(t for t in timeouts if t is not None)


MEMORY_TRACE_FILE = "memory_phases.jsonl"  # one line of memory transitions per step

# The exit status of `megarl train` stopped by SIGTERM after a checkpoint of its last step: the run
# is not finished, and a rerun with trainer.resume_mode=auto continues it. 75 is EX_TEMPFAIL of
# sysexits.h ("temporary failure, try again"); launch/slurm/megarl.sbatch requeues the job on it.
EXIT_STOPPED_FOR_RESUME = 75


class TrainingStopped(SystemExit):
    """Raised by `RLTrainer.fit` once a stop asked for by a signal is done (checkpoint written,
    metrics flushed); its `code` is the process's exit status: `EXIT_STOPPED_FOR_RESUME` when a rerun
    continues the run, else 128 + the signal number (no checkpoint to continue from)."""

    def __init__(self, code: int, step: int) -> None:
        super().__init__(code)
        self.step = step


def mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """An update's metrics over its data-parallel ranks: each key's mean over the ranks that report
    it (each rank's value describes its own shard of the batch; the loss, grad norm and LR are the
    same on every rank), as verl reduces its workers' metrics."""
    values: dict[str, list[float]] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            values.setdefault(key, []).append(float(value))
    return {key: math.fsum(vs) / len(vs) for key, vs in values.items()}


@dataclasses.dataclass
class QueuedSync:
    """A weight sync `RLTrainer.queue_generation` sent with the next step's generation, read when that
    generation is collected: its call, the engines' wake-ups around it (None when they never sleep),
    its memory probe, and how many worker calls all of it took (they count in the next step)."""

    syncing: CallHandle
    waking: Optional[CallHandle]
    waking_cache: Optional[CallHandle]
    probe: list[tuple[WorkerGroup, CallHandle]]
    calls: int


class RLTrainer:
    """Runs the algorithm of `cfg.algorithm` with the workers of `start_workers`."""

    def __init__(self, run: RunContext, spec: RunSpec, workers: Workers, tracker: Any, progress: Any) -> None:
        self.run = run
        self.cfg = run.cfg
        self.spec = spec
        self.workers = workers
        self.tracker = tracker
        self.progress = progress
        self.timer = Timer()
        alg = self.cfg.algorithm
        self.kl_ctrl = make_kl_controller(alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon)
        self.estimator = get_advantage_estimator(alg.adv_estimator)
        if (alg.filter_groups.enable and not self.cfg.trainer.total_training_steps
                and self.cfg.actor.optim.lr_scheduler != "constant"):
            logger.warning("algorithm.filter_groups with trainer.total_training_steps null: the %s learning-rate "
                           "schedule is sized for %d steps of one generation batch each, and dynamic sampling takes "
                           "several a step, so the run ends before the decay does; set trainer.total_training_steps",
                           self.cfg.actor.optim.lr_scheduler, run.total_steps)
        if spec.max_logprob_gap is not None and spec.logprob_gap_uncheckable is not None:
            logger.warning("rollout.max_logprob_gap is not checked on the training rows: %s; the "
                           "training/rollout_* metrics are logged, and rollout.probe_freq checks the weight sync on "
                           "a probe sampled without filters", spec.logprob_gap_uncheckable)
        self.response_length = spec.response_length
        self.global_step = 0
        self.weights_version = 0  # bumped by every actor update; the rollout syncs when behind
        self.rollout_version = -1
        self.pending_sleep: CallHandle | None = None  # a rollout sleep sent, its answer not read yet
        # Put to sleep by the driver and not woken since (engines start awake): a second sleep is not sent.
        self.rollout_asleep = False
        # A reward model in the rollout's processes (no resources.reward_model_pool, no rollout pool)
        # scores with the engines asleep (rollout.free_cache_engine), as verl's does: its parameters
        # and activations take the memory the KV cache held instead of coming on top of it.
        self.rm_beside_rollout = (workers.reward_model is not None
                                  and workers.reward_model.group is workers.rollout.group)
        self.sync_metrics: dict[str, float] = {}  # bytes moved by the last weight sync, all ranks
        self.probe_metrics: dict[str, float] = {}  # probe/*: the weight-sync probe run in this step
        self.probed_version = -1  # the last weight version the probe checked (rollout.probe_freq)
        # trainer.async_mode one_step_off / bounded_staleness: the next step's generation, launched
        # during this step, as (step, call handle, weight version it generates with, sampling, epoch of
        # its prompts); None when nothing is in flight. A row may be at most `max_staleness` versions
        # older than the weights it is trained from: one_step_off syncs before every launch (1),
        # bounded_staleness only when the bound requires it (trainer.max_staleness).
        mode = self.cfg.trainer.async_mode
        self.pipelined = mode != "sync"
        self.max_staleness = int(self.cfg.trainer.max_staleness) if mode == "bounded_staleness" else 1
        self.prefetch: Optional[tuple[int, Any, int, SamplingParams, int]] = None
        # The epoch of the loader batch the running step's rows came from (its last, with DAPO):
        # `training/epoch`. Not the loader's epoch when the step is read: by then the next step's
        # prompts may have been taken (pipelined modes, queue_generation), from the next epoch.
        self.batch_epoch = 0
        # trainer.queue_generation (sync mode, hybrid engine): the weight sync sent with the next
        # step's generation right behind the actor update, read when that generation is collected:
        # (sync call, weights wake-up, KV-cache wake-up), the wake-ups None when the engines never sleep.
        self.queued_sync: Optional[QueuedSync] = None
        # trainer.partial_rollout: that generation runs in chunks and stops once newer weights exist,
        # which the driver announces over `weight_signal` (unless it stops after a fixed number of
        # chunks); the step that trains on it syncs them and has the unfinished rows finished.
        self.partial = spec.rollout.partial if self.pipelined else None
        self.weight_signal: Optional[WeightSignal] = None
        if self.partial is not None and self.partial.interrupt_after is None:
            self.weight_signal = WeightSignal.serve(address_and_free_port()[0])
            workers.rollout.call_all(RolloutRole.connect_weight_signal, *self.weight_signal.address)
        self.synced_in_step = False
        self.rollout_busy_s = 0.0  # how long the slowest rollout rank generated the step's batch (all its rounds)
        self.step_version = 0  # weights_version at the start of the running step
        self.memory_trace: list[tuple[str, str, str]] = []  # (phase, role, transition) of this step
        self.memory_metrics: dict[str, float] = {}  # memory/<phase>/<stat> of this step
        # Memory probes sent at the end of each phase and not read yet: (phase, [(group, handle)]).
        self.memory_probes: list[tuple[str, list[tuple[WorkerGroup, CallHandle]]]] = []
        self.current_phase = "setup"
        # The reward model's own tokenizer when its token ids differ from the actor's (else None).
        self.rm_tokenizer = (reward_model_tokenizer(spec.reward_model.model_dir, run.tokenizer)
                             if spec.reward_model is not None else None)
        trained = {"actor": workers.actor}
        if workers.critic is not None:
            trained["critic"] = workers.critic
        # Where the update leaves out the rows of zero advantage and the old-log-prob pass is the only
        # pass (no reference, no critic: the advantages need nothing from a worker), the advantages
        # come first and the pass computes the rows the update runs only (step 4 after step 5).
        self.pass_after_advantages = bool(
            spec.actor.loss.skip_zero_advantage_rows and spec.actor.loss.old_log_prob_source == "recompute"
            and workers.ref is None and workers.critic is None and not self.cfg.algorithm.use_kl_in_reward)
        # Scores are needed first by the advantages (step 5), so the driver can compute them while the
        # workers run the first forward pass of step 4; not when the DAPO filter needs them to pick
        # the batch, nor with a reward model (its workers may be the ones computing), nor without a
        # pass before the advantages.
        has_pass = (spec.actor.loss.old_log_prob_source == "recompute" and not self.pass_after_advantages) \
            or workers.ref is not None or workers.critic is not None
        self.score_beside_pass = bool(self.cfg.reward.overlap and has_pass and workers.reward_model is None
                                      and not self.cfg.algorithm.filter_groups.enable)
        # Without a pass before the advantages, the rows are balanced after them, by the tokens of the
        # rows the update runs (skip_zero_advantage_rows).
        self.balance_update_rows = bool(spec.actor.loss.skip_zero_advantage_rows and not has_pass)
        self.checkpointer = TrainerCheckpointer(
            CheckpointDirs(run.run_dir / "checkpoints", self.cfg.trainer.max_ckpt_to_keep), trained,
            run.run_dir / "config.yaml")
        self.saved_step: Optional[int] = None  # the step of the checkpoint saved or resumed from last
        self.stop = StopRequest()  # a stop asked for by SIGTERM, armed by `fit` (stop_on_signal)

    # ------------------------------------------------------------------ the driver's own state
    def state_dict(self) -> dict[str, Any]:
        if self.prefetch is not None:  # the pipeline is drained before every save (see may_prefetch)
            raise RuntimeError(f"trainer state taken while the generation of step {self.prefetch[0]} is in flight")
        return {"global_step": self.global_step, "weights_version": self.weights_version,
                "dataloader": self.run.train_loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "rng": capture_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run.train_loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        restore_rng_state(state["rng"])
        self.global_step = int(state["global_step"])
        self.weights_version = int(state["weights_version"])
        self.rollout_version = -1  # the rollout engines must take the restored weights
        check_driver_state_restored(state, self.state_dict(), self.run.resume[1] if self.run.resume else None)

    # ------------------------------------------------------------------ the loop
    def fit(self, pending_signals: Sequence[int] = ()) -> dict[str, float]:
        """Train to the last step; returns the last validation metrics. SIGTERM stops at the next step
        boundary instead: `TrainingStopped` (a SystemExit) once its checkpoint is written.
        `pending_signals`: a SIGTERM received while the run started whose interrupt was lost
        (`ClusterInfo.sigterm`): the run stops at its first step boundary."""
        with stop_on_signal(pending=pending_signals) as self.stop:
            return self.train_until_done_or_stopped()

    def train_until_done_or_stopped(self) -> dict[str, float]:
        trainer = self.cfg.trainer
        state = self.checkpointer.load(self.run.resume)  # chosen and verified by prepare_run
        if state is not None:
            self.load_state_dict(state)
            self.saved_step = self.global_step
        # The steps after the checkpoint are trained again (a fresh run starts the file anew); a
        # validation-only pass over a checkpoint trains none and keeps them, as metrics.jsonl does.
        if not (trainer.val_only and self.run.resume):
            keep_steps_up_to(self.run.run_dir / MEMORY_TRACE_FILE, self.global_step)
        last_val: dict[str, float] = {}
        if self.run.val_dataset is not None and (trainer.val_only or (trainer.val_before_train and self.global_step == 0)):
            last_val = self.validate()
            self.tracker.log({**last_val, **self.outside_step_metrics()}, step=self.global_step)
            if self.memory_trace:
                self.write_memory_trace(self.global_step, validation_only=True)
        if trainer.val_only:
            return last_val
        self.progress.start()
        while not self.finished():
            # A step boundary. Not while a generation for the next step is in flight (pipelined modes,
            # queue_generation): that step runs first, and launches none once a stop is asked for.
            if self.stop.requested and self.prefetch is None:
                self.stop_at_boundary()
            step = self.global_step + 1
            with self.profiled(step):
                metrics = self.train_step(step)
            self.global_step = step
            is_last = self.finished()
            if self.run.val_dataset is not None and ((trainer.test_freq > 0 and step % trainer.test_freq == 0) or is_last):
                last_val = self.validate()
                metrics.update(last_val)
            metrics.update(self.outside_step_metrics())
            if self.data_bounded_sampling:  # its steps take a varying number of loader batches
                self.progress.set_total_steps(estimated_last_step(
                    step, self.run.train_loader.batches_handed_out - (self.prefetch is not None),
                    self.cfg.trainer.total_epochs * len(self.run.train_loader)))
            if trainer.save_freq > 0 and (step % trainer.save_freq == 0 or is_last):
                self.save_and_log(step, metrics)
            else:
                self.log_step(step, metrics)
            self.progress.step_done(step, reward=metrics.get("critic/score/mean"))
        return last_val

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Step `step`'s line of `metrics.jsonl` (and of the other backends) and of `memory_phases.jsonl`."""
        self.write_memory_trace(step)
        self.tracker.log(metrics, step=step)

    def save_and_log(self, step: int, metrics: dict[str, Any]) -> None:
        """The checkpoint of `step`, with the step's metrics logged, and the tracker flushed, once the
        checkpoint is written and before it is committed (renamed): a run killed after the commit
        resumes at `step + 1` with this step's line kept, one killed before it resumes from an earlier
        checkpoint and drops the line (a resume keeps the lines up to its checkpoint's step), so every
        step is logged once, as in an uninterrupted run. `timing_s/save_checkpoint`, in that line, is
        the save up to the commit (the rename, the latest file and pruning old checkpoints after it
        are not counted)."""
        started = time.perf_counter()

        def log_before_commit() -> None:
            metrics["timing_s/save_checkpoint"] = time.perf_counter() - started
            self.log_step(step, metrics)
            # The store then holds every step up to this checkpoint: a run resumed from it does not
            # log them again (mlflow_backend).
            self.tracker.flush()

        self.checkpointer.save(step, self.state_dict(), before_commit=log_before_commit)
        self.saved_step = step

    def stop_at_boundary(self) -> None:
        """The stop SIGTERM asked for, between two steps: a checkpoint of the last finished step
        (unless it has one: a periodic save, or the checkpoint this run resumed from), the metrics
        flushed, then `TrainingStopped`. Its exit status is `EXIT_STOPPED_FOR_RESUME` when a rerun
        continues from here, else 128 + the signal: no checkpoint (`trainer.save_freq` <= 0), or a
        rerun would resume from elsewhere (`trainer.resume_mode` not auto)."""
        trainer, step, name = self.cfg.trainer, self.global_step, self.stop.signal_name
        self.tracker.flush()  # the store holds every step before the checkpoint, as at a periodic save
        if step == 0:
            where = "no step trained yet"
        elif self.saved_step == step:
            where = f"its checkpoint is {self.checkpointer.dirs.step_dir(step)}"
        elif trainer.save_freq <= 0:
            logger.warning("stopped by %s after step %d without a checkpoint (trainer.save_freq=%d: none are "
                           "written); a rerun starts over. Set trainer.save_freq > 0 for a stop that keeps the "
                           "steps trained", name, step, trainer.save_freq)
            raise TrainingStopped(128 + int(self.stop.signum), step)
        else:
            where = f"checkpoint {self.checkpointer.save(step, self.state_dict())}"
            self.saved_step = step
        if trainer.resume_mode != "auto":
            logger.warning("stopped by %s after step %d (%s); trainer.resume_mode=%s: a rerun does not continue "
                           "from here unless it sets trainer.resume_mode=auto", name, step, where, trainer.resume_mode)
            raise TrainingStopped(128 + int(self.stop.signum), step)
        logger.warning("stopped by %s after step %d (%s); exit status %d: a rerun with trainer.resume_mode=auto "
                       "(the default) continues from here", name, step, where, EXIT_STOPPED_FOR_RESUME)
        raise TrainingStopped(EXIT_STOPPED_FOR_RESUME, step)

    def outside_step_metrics(self) -> dict[str, float]:
        """`timing_s/val` and `memory/val/*` of the validation that followed a step (or came before
        the first), logged with that step (as `timing_s/save_checkpoint` is, by `save_and_log`); they
        are not in `timing_s/step`. The phases timed inside the validation (its generation and
        weight sync) are part of `timing_s/val`, not of the next step's `gen` and `sync_weights`."""
        timings = self.timer.pop()
        metrics = {f"timing_s/{name}": timings[name] for name in OUTSIDE_STEP_PHASES if name in timings}
        self.read_memory_probes()
        metrics.update({key: value for key, value in self.memory_metrics.items() if key.startswith("memory/val/")})
        self.memory_metrics = {}
        return metrics

    @property
    def data_bounded_sampling(self) -> bool:
        """A run that ends when its data is used (no trainer.total_training_steps) and whose steps take
        several loader batches each (algorithm.filter_groups): its last step is estimated as it goes."""
        return bool(self.cfg.algorithm.filter_groups.enable and not self.cfg.trainer.total_training_steps)

    def finished(self) -> bool:
        """`trainer.total_training_steps` done, or (when it is null) the data of `total_epochs` used."""
        if self.global_step >= self.run.total_steps:
            return True
        if self.cfg.trainer.total_training_steps:
            return False
        handed_out = self.run.train_loader.batches_handed_out - (self.prefetch is not None)  # not trained yet
        return handed_out >= self.cfg.trainer.total_epochs * len(self.run.train_loader)

    def train_step(self, step: int) -> dict[str, Any]:
        cfg, alg = self.cfg, self.cfg.algorithm
        actor, ref, critic = self.workers.actor, self.workers.ref, self.workers.critic
        metrics: dict[str, Any] = {"training/global_step": step}
        self.step_version = self.weights_version  # the weights this step's batch is trained from
        # sync/* describe the weight syncs this step runs (for its generation, or in the pipelined
        # modes before launching the next step's), not one a validation ran before it (in timing_s/val).
        self.synced_in_step, self.sync_metrics = False, {}
        # Calls sent by the last step for this one (a queued generation) count as this step's.
        calls_before = self.worker_calls_sent() - self.queued_calls()
        # This step's batch was generated behind the last update (trainer.queue_generation).
        metrics["training/generation_queued"] = float(self.queued_sync is not None)
        with self.timer("step"):
            # 1-3. prompts -> responses -> scores (DAPO: until enough groups carry a signal); with
            #      `score_beside_pass` the scores come with the first pass of step 4
            batch, gen_metrics = self.collect_scored_batch(step, score=not self.score_beside_pass)
            metrics["training/epoch"] = self.batch_epoch  # of the step's (last) generation batch
            metrics.update(gen_metrics)
            metrics.update(self.staleness_metrics(batch))
            metrics.update(partial_metrics(batch, self.step_version))
            # The rollout pool's own time on this step's rows (in the pipelined modes it overlaps the
            # previous step; timing_s/gen is then only the wait for it). Not a timing_s/ phase: the
            # phases add up to the step, and this one may lie outside it.
            metrics["async/rollout_busy_s"] = self.rollout_busy_s
            metrics.update(agent_metrics(batch))  # multi-turn rollouts: turns, tool calls, errors, latency
            # Training needs the memory: the KV cache (and weights) go; asleep already when a reward
            # model in the rollout's processes scored the batch.
            self.rollout_sleep()
            # Rows reordered so each actor DP rank gets about the same tokens (trainer.balance_batch);
            # advantages group by uid, not position; the rollout order comes back before the dump.
            restore = None
            if not self.balance_update_rows:
                batch, restore = self.balance(batch, batch["attention_mask"], metrics)

            # 4. log-probs of the behaviour policy (a pass of the actor, unless the update itself or the
            #    rollout engine supplies them: actor.old_log_prob_source), the reference, the critic's values
            source = self.spec.actor.loss.old_log_prob_source
            metrics["training/old_log_prob_source"] = OLD_LOG_PROB_SOURCES.index(source)
            metrics["training/reward_overlapped"] = float(self.score_beside_pass)
            unscored = self.score_beside_pass  # the first pass below scores beside its workers
            if source == "recompute" and not self.pass_after_advantages:
                with self.phase("old_log_prob"), self.onloaded(actor, self.spec.actor, params_only=True):
                    batch = self.forward_pass(actor, ActorRole.compute_log_prob, batch, metrics, unscored)
                unscored = False
                metrics.update(self.rollout_mismatch(batch, batch["old_log_probs"], step))
            elif source == "rollout":
                batch["old_log_probs"] = batch["rollout_log_probs"]
            if ref is not None:
                with self.phase("ref"), self.onloaded(ref, self.spec.ref, params_only=True):
                    batch = self.forward_pass(ref, RefRole.compute_ref_log_prob, batch, metrics, unscored)
                unscored = False
            if critic is not None:
                with self.phase("values"), self.onloaded(critic, self.spec.critic, params_only=True):
                    batch = self.forward_pass(critic, CriticRole.compute_values, batch, metrics, unscored)
                unscored = False

            # 5. rewards (with KL when configured) and advantages, on the driver's CPU
            with self.phase("adv"):
                batch, adv_metrics = self.compute_advantages(batch)
                metrics.update(adv_metrics)
                if self.balance_update_rows:  # the tokens of the rows the update will run
                    runs = rows_with_advantage(batch["advantages"], batch["response_mask"])
                    batch, restore = self.balance(batch, batch["attention_mask"] * runs.unsqueeze(-1), metrics)
            if self.pass_after_advantages:  # 4. old log-probs of the rows the update runs
                with self.phase("old_log_prob"), self.onloaded(actor, self.spec.actor, params_only=True):
                    batch, passed = self.old_log_probs_of_rows_run(batch, metrics)
                metrics.update(self.rollout_mismatch(batch[passed], batch["old_log_probs"][passed], step))

            # 6. updates: critic first, actor after the warm-up
            if critic is not None:
                with self.phase("update_critic"), self.onloaded(critic, self.spec.critic):
                    metrics.update(mean_over_ranks(critic.call_dp(CriticRole.update_critic, batch)))
            if step > cfg.trainer.critic_warmup:
                queue = self.may_queue_generation(step, self.weights_version + 1)
                with self.phase("update_actor"), self.onloaded(actor, self.spec.actor):
                    update = actor.call_dp_async(ActorRole.update_actor, batch)
                    if queue:  # the update's memory probe first, then the next sync and generation
                        self.probe_memory("update_actor", (actor.group,))
                        self.queue_generation(step, self.weights_version + 1)
                    per_rank = update.result(actor.group.call_timeout_s)  # ActorUpdate per DP rank, in order
                    metrics.update(mean_over_ranks([update.metrics for update in per_rank]))
                    if source != "recompute":  # the trainer's log-probs of the sampling weights
                        # The padding rows of the split come last: the first len(batch) are the batch's.
                        update_log_probs = torch.cat([shard.log_probs for shard in per_rank])[: len(batch)]
                self.weights_version += 1
                if self.weight_signal is not None:  # a partial rollout in flight stops at its next chunk
                    self.weight_signal.raise_to(self.weights_version)
                if source != "recompute":
                    if source == "update":
                        batch["old_log_probs"] = update_log_probs
                    metrics.update(self.rollout_mismatch(batch, update_log_probs, step))

        # 7. metrics
        if restore is not None:
            batch = batch[restore]
        if cfg.trainer.rollout_data_dir:
            dump_rollouts(batch, self.run.tokenizer, step, cfg.trainer.rollout_data_dir)
        inner, timings = self.timer.inner(), self.timer.pop()
        total_tokens, response_tokens = count_tokens(batch)
        metrics.update(compute_data_metrics(batch, max_response_length=self.response_length,
                                            max_prompt_length=cfg.data.max_prompt_length))
        metrics.update(compute_timing_metrics(timings, total_tokens, response_tokens, inner=inner))
        metrics.update(compute_throughput(total_tokens, timings["step"], self.n_devices))
        metrics["sync/synced"] = float(self.synced_in_step)  # a weight sync ran in this step (see its start)
        metrics.update(self.sync_metrics)  # of the last sync this step ran; none when it ran none
        self.synced_in_step, self.sync_metrics = False, {}
        metrics.update(self.probe_metrics)
        self.probe_metrics = {}
        if self.prefetch is None:  # else the sleep waits behind the next step's generation: read it then
            self.settle_rollout_sleep()
        self.read_memory_probes()
        metrics["perf/worker_calls"] = float(self.worker_calls_sent() - calls_before - self.queued_calls())
        metrics.update(self.memory_metrics)
        metrics.update(memory_step_metrics(self.memory_metrics))
        self.memory_metrics = {}
        return metrics

    def balance(self, batch: Batch, token_mask: torch.Tensor, metrics: dict[str, Any]
                ) -> tuple[Batch, Optional[torch.Tensor]]:
        """`batch` reordered so that each actor DP rank gets about the same tokens of `token_mask`
        (B, T) (trainer.balance_batch; metrics `global_seqlen/*`), and the order that restores it
        (None: not reordered)."""
        dp = plan_dispatch(self.workers.actor.group.rank_coords).dp_size
        if not (self.cfg.trainer.balance_batch and balance_applies(len(batch), dp)):
            return batch, None
        # With prompt sharing a group's rows stay together (so that its prompt can be computed
        # once where the engine shares prompts: not on a GPU, model.prompt_sharing).
        groups = batch["uid"] if self.cfg.model.prompt_sharing != "never" and "uid" in batch else None
        order, balance_metrics = balance_order(token_mask, dp, groups)
        metrics.update(balance_metrics)
        return batch[order], torch.argsort(order)

    def queued_calls(self) -> int:
        """Worker calls sent for the next step by a queued generation still in flight (they count there)."""
        return self.queued_sync.calls if self.queued_sync is not None else 0

    def worker_calls_sent(self) -> int:
        """Ray calls the driver has sent to worker processes so far (one per rank and method), over
        every group; a step's count is its `perf/worker_calls`, the driver's overhead in calls."""
        return sum(group.calls_sent for group in self.workers.groups)

    # ------------------------------------------------------------------ phases
    @contextlib.contextmanager
    def phase(self, name: str, ran_on: tuple[WorkerGroup, ...] = ()) -> Iterator[None]:
        """Time `name`, show it in the progress display, and record the memory peak of the workers
        it called, and of `ran_on` (groups that ran calls sent before it, e.g. a queued generation)."""
        self.current_phase = name
        sent_before = {id(group): group.calls_sent for group in self.workers.groups}
        with self.timer(name), self.progress.phase(name):
            yield
        # Not the rollout pool while it generates the next batch: the probe would wait for it.
        busy = self.workers.rollout.group if self.prefetch is not None else None
        # Only the groups this phase sent calls to: a phase that ran on the driver alone (reward
        # scoring, advantages) leaves the workers idle, and the next probe's peak covers its span
        # anyway. Two probes fewer per step cut the quickstart step's driver overhead
        # (benchmarks/HISTORY.md).
        called = [group for group in self.workers.groups
                  if group is not busy and (group.calls_sent != sent_before.get(id(group), 0) or group in ran_on)]
        self.probe_memory(name, called)

    def probe_memory(self, phase: str, groups: Iterable[WorkerGroup]) -> None:
        """Send `HostWorker.memory_stats` to `groups` for `phase`, without waiting: a worker runs the
        driver's calls in the order they were sent, so the probe reads the peak of the calls sent
        before it, before those sent after it start; the results are read at the end of the step
        (`read_memory_probes`), saving a round trip per phase."""
        handles = [(group, group.call_all_async(HostWorker.memory_stats)) for group in groups]
        if handles:
            self.memory_probes.append((phase, handles))

    def read_memory_probes(self) -> None:
        """Fold the memory probes sent so far into this step's `memory/<phase>/...` metrics."""
        probes, self.memory_probes = self.memory_probes, []
        for name, handles in probes:
            per_rank = [stats for group, handle in handles for stats in handle.result(group.call_timeout_s)]
            for key, value in memory_phase_metrics(name, per_rank).items():
                self.memory_metrics[key] = max(value, self.memory_metrics.get(key, value))

    @contextlib.contextmanager
    def onloaded(self, role: RoleView, spec: Optional[EngineRoleSpec], params_only: bool = False) -> Iterator[None]:
        """The role's offloaded state (per its `*_offload` keys) on the device for the body only:
        all of it for an update, the parameters only (`params_only`) for a forward pass or a sync."""
        if spec is None or not (spec.offload.params if params_only else spec.offload.any):
            yield
            return
        role.call_all(EngineRole.onload, params_only)
        self.trace_memory(self.current_phase, spec.name, "onload:params" if params_only else "onload")
        try:
            yield
        finally:
            role.call_all(EngineRole.offload)
            self.trace_memory(self.current_phase, spec.name, "offload")

    def rollout_sleep(self, after: str = "gen") -> None:
        """Put the rollout engines to sleep (`rollout.free_cache_engine`) once the generation of
        `after` is done (with a reward model in their processes, unless they sleep since the last
        wake-up); when that discards their weights, the next generation syncs them again."""
        # Skipped only where the reward model's scoring sent it already (`score`); elsewhere a sleep is
        # sent as before, also to engines asleep since a validation (the queued path's trace and calls
        # then equal those of the path without the queue).
        if not self.spec.rollout.free_cache_engine or (self.rm_beside_rollout and self.rollout_asleep):
            return
        # Sent without waiting: a worker runs the driver's calls in the order they were sent, so the
        # training calls sent next run after it; whether it discarded the weights is read before the
        # rollout is used again (`settle_rollout_sleep`), saving a round trip per step.
        self.settle_rollout_sleep()
        self.pending_sleep = self.workers.rollout.call_all_async(RolloutRole.sleep)
        self.rollout_asleep = True
        self.trace_memory(after, "rollout", "sleep")

    def rollout_wake_up(self, tags: tuple[str, ...] | None = None) -> CallHandle | None:
        """Send the rollout engines `RolloutRole.wake_up(tags)` without waiting; None, and no call,
        when they never sleep (`rollout.free_cache_engine` off: an engine starts awake and only the
        driver puts it to sleep), which saves two calls to every rollout worker a step."""
        if not self.spec.rollout.free_cache_engine:
            return None
        self.rollout_asleep = False
        return self.workers.rollout.call_all_async(RolloutRole.wake_up, tags)

    def settle_rollout_wake_up(self, waking: CallHandle | None, phase: str, transition: str = "wake_up") -> None:
        """Wait for a wake-up sent by `rollout_wake_up`; when it woke the engines, record the
        transition in `phase`'s memory trace."""
        if waking is not None and waking.result(self.workers.rollout.group.call_timeout_s)[0]:
            self.trace_memory(phase, "rollout", transition)

    def settle_rollout_sleep(self) -> None:
        """Read the answer of the sleep sent last, if any: when it discarded the rollout's weights,
        the next generation syncs them again."""
        if self.pending_sleep is None:
            return
        handle, self.pending_sleep = self.pending_sleep, None
        if any(handle.result(self.workers.rollout.group.call_timeout_s)):
            self.rollout_version = -1

    def trace_memory(self, phase: str, role: str, transition: str) -> None:
        """Record a memory transition of `role` in `phase`; during a validation the phase is "val"
        (its weight sync and generation are not the step's)."""
        self.memory_trace.append(("val" if "val" in self.timer.open_phases else phase, role, transition))

    def write_memory_trace(self, step: int, **marks: bool) -> None:
        """The memory transitions of `step` and of the validation and checkpoint after it (phase
        "val") as one line of `<run>/memory_phases.jsonl`; `marks` are added to the line (a
        validation before training, or alone, is written with ``validation_only``, and only when it
        changed anything)."""
        with open(self.run.run_dir / MEMORY_TRACE_FILE, "a") as f:
            f.write(json.dumps({"step": step, **marks, "transitions": [list(t) for t in self.memory_trace]}) + "\n")
        self.memory_trace = []

    @contextlib.contextmanager
    def profiled(self, step: int) -> Iterator[None]:
        """Torch profiler traces of `step` from every worker when it is in `trainer.profile_steps`."""
        if step not in self.cfg.trainer.profile_steps:
            yield
            return
        groups = self.workers.groups
        out_dir = str(self.run.run_dir / "profile")
        for group in groups:
            group.call_all(HostWorker.start_profile, step, out_dir)
        try:
            yield
        finally:
            traces = [path for group in groups for path in group.call_all(HostWorker.stop_profile)]
            logger.info("profile of step %d: %d traces under %s", step, len(traces), out_dir)

    def sync_rollout(self) -> None:
        """Bring the rollout engines to the actor's current weights, when they are behind: inside
        the actor's processes (hybrid engine), or over the bridge to a rollout pool of its own."""
        self.settle_rollout_sleep()
        if self.rollout_version == self.weights_version:
            return
        self.synced_in_step = True
        rollout = self.workers.rollout
        with self.phase("sync_weights"), self.onloaded(self.workers.actor, self.spec.actor, params_only=True):
            if self.workers.separate_rollout:
                sending = self.workers.actor.call_all_async(ActorRole.send_weights)
                receiving = rollout.call_all_async(RolloutRole.receive_weights, self.weights_version)
                # Waited on together: a rank that dies on either side fails the sync at once, named
                # by its own group, not as the other side's broken connection.
                senders, per_rank = gather(sending, receiving, timeout_s=longest_timeout(
                    self.workers.actor.group.call_timeout_s, rollout.group.call_timeout_s))
            else:
                # Both sent at once (a worker runs them in turn): one round trip instead of two.
                waking = self.rollout_wake_up(("weights",))
                per_rank = rollout.call_all(RolloutRole.sync_weights, self.weights_version)
                self.settle_rollout_wake_up(waking, self.current_phase, "wake_up:weights")
                senders = []
        self.rollout_version = self.weights_version
        self.record_sync(per_rank)
        if senders:  # separate placement: the reshard inside the training pool, before the bridge
            self.sync_metrics["sync/bytes_within_training"] = sum(r["sync/bytes_within_training"] for r in senders)
            self.sync_metrics["sync/bytes_sent"] = sum(r["sync/bytes_sent"] for r in senders)
        freq = int(self.cfg.rollout.probe_freq)
        if freq and self.rollout_version % freq == 0 and self.rollout_version != self.probed_version:
            self.probe_sync()

    def record_sync(self, per_rank: list[dict[str, float]]) -> None:
        """`sync/*` of the step from each rollout rank's side of a weight sync."""
        self.sync_metrics = {k: (sum if k.startswith("sync/bytes") else max)(r[k] for r in per_rank)
                             for k in per_rank[0]
                             if k.startswith("sync/bytes") or k in ("sync/pieces_verified", "sync/verify_s")}
        self.sync_metrics["sync/seconds_max"] = max(r["sync/seconds"] for r in per_rank)
        # Bytes a rollout rank received beyond its minimum: 0 on every rank is the zero-redundancy claim.
        self.sync_metrics["sync/bytes_excess_max"] = max(r["sync/bytes_received"] - r["sync/bytes_minimum"]
                                                         for r in per_rank)

    def may_queue_generation(self, step: int, version: int) -> bool:
        """Whether step `step` sends the next step's weight sync (of weights `version`, those its actor
        update makes) and generation right behind the update (`trainer.queue_generation`): sync mode
        with the rollout in the actor's processes (the workers then run the calls in the order sent,
        so the generation uses the updated weights), the actor's state not offloaded (its offload
        comes after the update), and a next step that may be prefetched (not the last, not at a
        checkpoint) and is not profiled, nor a sync the probe (`rollout.probe_freq`) checks."""
        trainer = self.cfg.trainer
        if not trainer.queue_generation or self.pipelined or self.workers.separate_rollout:
            return False
        if self.spec.actor.offload.any or step in trainer.profile_steps or step + 1 in trainer.profile_steps:
            return False
        freq = int(self.cfg.rollout.probe_freq)
        if freq and version % freq == 0:
            return False
        return self.may_prefetch(step)

    def queue_generation(self, step: int, version: int) -> None:
        """Send the weight sync and the generation of step `step + 1` right behind this step's
        update (which makes weights `version`): the workers update, sync and generate in turn while
        the driver waits for the update and finishes the step (metrics, logging, the next batch),
        with the prompts, seed and weights that step would have used (the calls `generate` sends, in
        its order). Collected by `rollout_batch`."""
        rollout = self.workers.rollout
        self.settle_rollout_sleep()  # sent before the update: the rollout has slept by now or will first
        (prompts, epoch), sampling = self.next_prompts(), self.sampling((step + 1) * 1000)
        calls_before = self.worker_calls_sent()
        waking = self.rollout_wake_up(("weights",))
        syncing = rollout.call_all_async(RolloutRole.sync_weights, version)
        # The sync's memory probe, where the end of its phase would send it (read with the sync).
        probe = [(rollout.group, rollout.group.call_all_async(HostWorker.memory_stats))]
        waking_cache = self.rollout_wake_up()
        handle = rollout.call_dp_async(RolloutRole.generate, prompts, sampling,
                                       dispatch_coords=self.workers.rollout_coords)
        self.queued_sync = QueuedSync(syncing, waking, waking_cache, probe, self.worker_calls_sent() - calls_before)
        self.rollout_version = version
        self.prefetch = (step + 1, handle, version, sampling, epoch)

    def settle_queued_sync(self) -> None:
        """Read the answers of a sync sent by `queue_generation` (the generation behind it is done).
        Its wake-ups enter this step's memory trace as a sync sent here would record them (under
        `sync_weights`), so the trace is the same with and without the queue."""
        if self.queued_sync is None:
            return
        queued, self.queued_sync = self.queued_sync, None
        self.settle_rollout_wake_up(queued.waking, "sync_weights", "wake_up:weights")
        self.record_sync(queued.syncing.result(self.workers.rollout.group.call_timeout_s))
        self.memory_probes.append(("sync_weights", queued.probe))
        self.synced_in_step = True
        self.settle_rollout_wake_up(queued.waking_cache, "sync_weights")

    def probe_sync(self) -> None:
        """The end-to-end check of the weight sync just done (`rollout.probe_freq`): the rollout
        engines sample one response to each probe prompt (the training sampling, one fixed seed, so
        the engines' own random streams are untouched), the actor scores the same tokens with the
        weights it sent; `probe/logprob_abs_diff_{mean,max}` and `probe/probs_diff_{mean,max}`, and
        `rollout.max_logprob_gap` stops the run. The actor holds the synced weights here: a sync runs
        before an update, never during one."""
        rollout, actor = self.workers.rollout, self.workers.actor
        # Without top-p / top-k, so that the rollout's log-probs are the trainer's quantity whatever the
        # training sampling filters.
        sampling = with_seed(dataclasses.replace(self.spec.train_sampling, n=1, top_p=1.0, top_k=-1),
                             int(self.cfg.trainer.seed) * 100003 - 1)
        self.settle_rollout_wake_up(self.rollout_wake_up(), self.current_phase)
        with self.phase("probe"):
            gen = rollout.call_dp(RolloutRole.probe, self.run.probe_prompts, sampling,
                                  dispatch_coords=self.workers.rollout_coords)
            with self.onloaded(actor, self.spec.actor, params_only=True):
                scored = actor.call_dp(ActorRole.compute_log_prob, gen)
        gap = logprob_gap(scored["old_log_probs"], gen["rollout_log_probs"], gen["response_mask"])
        if not gap:  # every response holds at least its first token
            raise RuntimeError(f"weight-sync probe of version {self.rollout_version}: no response token to compare")
        self.probe_metrics = {"probe/" + key.removeprefix("training/rollout_"): value for key, value in gap.items()}
        self.probe_metrics["probe/weights_version"] = float(self.rollout_version)
        self.probed_version = self.rollout_version
        check_logprob_gap(self.global_step + 1, gap["training/rollout_logprob_abs_diff_mean"], self.spec.max_logprob_gap,
                          f"the probe batch ({len(gen)} responses to the first rollout.probe_prompts training prompts, "
                          f"weights of version {self.rollout_version})")

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Responses for `prompts` from the rollout engines (synced to the actor's weights first);
        each row records the weight version it was generated with (`rollout_weights_version`)."""
        rollout = self.workers.rollout
        self.sync_rollout()
        # The KV cache, after the sync's buffers are freed; the generation is sent behind it at once.
        waking, woken_in = self.rollout_wake_up(), self.current_phase
        with self.phase("gen"):
            out = rollout.call_dp(RolloutRole.generate, prompts, sampling, dispatch_coords=self.workers.rollout_coords)
        self.settle_rollout_wake_up(waking, woken_in)
        out["rollout_weights_version"] = torch.full((len(out),), self.rollout_version, dtype=torch.int64)
        return self.take_busy_time(out)

    def take_busy_time(self, out: Batch) -> Batch:
        """Keep how long the slowest rollout rank generated `out` (`async/rollout_busy_s` of the step
        that trains on it) and drop the column."""
        if ROLLOUT_BUSY in out:
            self.rollout_busy_s = float(out.pop(ROLLOUT_BUSY)[ROLLOUT_BUSY].max())
        return out

    def rollout_batch(self, step: int, attempt: int) -> Batch:
        """The generations step `step` trains on: launched during the previous step (pipelined
        modes) or generated now. In the pipelined modes the next step's generation is then launched,
        with weights from before this step's update, so that it runs while this step trains: the
        latest (one_step_off), or those the rollout has while they are within `max_staleness`
        versions of the weights that will train on the rows (bounded_staleness)."""
        rollout = self.workers.rollout
        self.settle_rollout_sleep()
        if self.prefetch is not None:
            launched_for, handle, version, sampling, self.batch_epoch = self.prefetch
            if launched_for != step or attempt != 0:
                raise RuntimeError(f"generation in flight for step {launched_for}, asked for step {step}")
            # Here only the wait: what the training pool idles for. A generation queued behind the
            # update (trainer.queue_generation) ran on the workers since the last probe: probed here.
            with self.phase("gen", ran_on=(rollout.group,) if self.queued_sync is not None else ()):
                out = handle.result(rollout.group.call_timeout_s)
                self.prefetch = None  # the rollout is idle again: the phase's memory probe may go
            self.settle_queued_sync()
            out = self.take_busy_time(out)
            if OPEN in out:
                out = self.finish_partial(out, sampling)
            else:
                out["rollout_weights_version"] = torch.full((len(out),), version, dtype=torch.int64)
        else:
            prompts, self.batch_epoch = self.next_prompts()
            out = self.generate(prompts, self.sampling(step * 1000 + attempt))
        if self.pipelined and self.may_prefetch(step):
            # The next step trains with the weights after this step's update (if the actor updates).
            trained_with = self.weights_version + int(step > self.cfg.trainer.critic_warmup)
            if trained_with - self.rollout_version > self.max_staleness:
                self.sync_rollout()
            (prompts, epoch), sampling = self.next_prompts(), self.sampling((step + 1) * 1000)
            if self.partial is None:
                handle = rollout.call_dp_async(RolloutRole.generate, prompts, sampling,
                                               dispatch_coords=self.workers.rollout_coords)
            else:  # interruptible once weights newer than today's exist
                rows = open_rows(prompts, sampling.n, self.response_length, self.spec.rollout.options.pad_token_id)
                handle = rollout.call_dp_async(RolloutRole.generate_partial, rows, sampling, self.rollout_version,
                                               self.weights_version, dispatch_coords=self.workers.rollout_coords)
            self.prefetch = (step + 1, handle, self.rollout_version, sampling, epoch)
        return out

    def next_prompts(self) -> tuple[Batch, int]:
        """The loader's next batch of prompts and the epoch it is from (the loader moves into an epoch
        as it hands out the epoch's first batch)."""
        prompts = self.run.train_loader.next_batch()
        return prompts, int(self.run.train_loader.epoch)

    def finish_partial(self, rows: Batch, sampling: SamplingParams) -> Batch:
        """A partial rollout's rows (`trainer.partial_rollout`) once it stopped: when rows are
        unfinished, the rollout takes the actor's newest weights and generates them to their end
        (from their tokens, or again from the prompt with `drop`). A row's `rollout_weights_version`
        is its oldest token's."""
        if bool(rows[OPEN].any()):
            first_part_s = self.rollout_busy_s
            self.sync_rollout()
            with self.phase("gen"):
                rows = self.workers.rollout.call_dp(RolloutRole.generate_partial, rows, sampling, self.rollout_version,
                                                    None, dispatch_coords=self.workers.rollout_coords)
            rows = self.take_busy_time(rows)
            self.rollout_busy_s += first_part_s
        rows.pop(OPEN)
        rows["rollout_weights_version"] = oldest_versions(rows)
        return rows

    def may_prefetch(self, step: int) -> bool:
        """Whether step `step` may launch the generation of the next one: not at the last step, and
        not at a checkpoint step, so that a checkpoint holds nothing in flight and a resume generates
        what the uninterrupted run generated (with the same weights and seed)."""
        trainer = self.cfg.trainer
        if step >= self.run.total_steps or self.stop.requested:  # a stop needs nothing in flight
            return False
        if not trainer.total_training_steps:  # ends with the data: a next batch must exist
            left = trainer.total_epochs * len(self.run.train_loader) - self.run.train_loader.batches_handed_out
            if left < 1:
                return False
        return not (trainer.save_freq > 0 and step % trainer.save_freq == 0)

    def forward_pass(self, role: RoleView, method: Any, batch: Batch, metrics: dict[str, Any],
                     score_beside: bool) -> Batch:
        """`batch` joined with what `role.method` computes on it (split over the role's DP ranks).
        With `score_beside`, the driver scores the batch (step 3) while the workers compute: the
        call is sent first (its shards are copied out before the scores are written), then the
        reward phase runs here, then the driver waits for the workers."""
        if not score_beside:
            return batch.union(role.call_dp(method, batch))
        handle = role.call_dp_async(method, batch)
        # Timed apart from the pass around it; not a `phase`, whose memory probe of the workers
        # would queue behind the call in flight.
        with self.timer("reward"), self.progress.phase("reward"):
            batch, reward_metrics = self.score(batch)
        metrics.update(reward_metrics)
        return batch.union(handle.result(role.group.call_timeout_s))

    def old_log_probs_of_rows_run(self, batch: Batch, metrics: dict[str, Any]) -> tuple[Batch, torch.Tensor]:
        """`batch` with `old_log_probs` and `entropys` of the rows of nonzero advantage, computed by
        the actor's pass on those rows alone (balanced over its DP ranks by their tokens), NaN on the
        others, which no optimizer step runs (a row the update must run on a rank with none of them
        takes its own log-probs: `make_actor_loss`); and the indices of the rows computed. Without a
        row of nonzero advantage it computes the row of fewest tokens, so that the rollout-vs-trainer
        gap is still measured and checked (rollout.max_logprob_gap).
        Metrics `training/old_log_prob_rows_skipped` and `training/old_log_prob_tokens_skipped`: the
        shares of the rows and of their tokens (prompt + response) left out."""
        tokens = batch["attention_mask"].sum(dim=-1)
        passed = rows_with_advantage_or_one(batch["advantages"], batch["response_mask"], tokens).nonzero().squeeze(-1)
        metrics["training/old_log_prob_rows_skipped"] = 1.0 - len(passed) / len(batch)
        metrics["training/old_log_prob_tokens_skipped"] = (1.0 - float(tokens[passed].sum())
                                                           / max(float(tokens.sum()), 1.0))
        rows, restore = self.balance(batch[passed], batch["attention_mask"][passed], {})
        out = self.workers.actor.call_dp(ActorRole.compute_log_prob, rows)
        for key in ("old_log_probs", "entropys"):
            values = torch.full(tuple(batch["response_mask"].shape), float("nan"))
            values[passed] = out[key][restore] if restore is not None else out[key]
            batch[key] = values
        return batch, passed

    def sampling(self, step: int, validation: bool = False) -> SamplingParams:
        """The sampling parameters of training (or validation) at `step`, with a seed of their own."""
        seed = int(self.cfg.trainer.seed) * 100003 + step * 2 + int(validation)
        return with_seed(self.spec.val_sampling if validation else self.spec.train_sampling, seed)

    def collect_scored_batch(self, step: int, score: bool = True) -> tuple[Batch, dict[str, Any]]:
        """Generate and score; with DAPO's group filter, repeat until `train_batch_size` groups remain.

        Each round takes one loader batch (`data.gen_batch_size` prompts with the filter on).
        score=False (no filter): generate only, the caller scores.
        """
        fg = self.cfg.algorithm.filter_groups
        needed = int(self.cfg.data.train_batch_size)
        state = DynamicSamplingState(num_prompts_needed=needed, max_num_gen_batches=fg.max_num_gen_batches)
        kept: list[Batch] = []
        metrics: dict[str, Any] = {}
        scored_rows = 0  # rows scored in the rounds so far
        busy_s = 0.0  # the rollout's generation time of the rounds so far (async/rollout_busy_s)
        attempt = 0
        while True:
            self.rollout_busy_s = 0.0  # this round's, set by `take_busy_time`
            gen = self.rollout_batch(step, attempt)
            busy_s += self.rollout_busy_s
            self.rollout_busy_s = busy_s
            attempt += 1
            if not score:
                return gen, metrics
            with self.phase("reward"):
                gen, reward_metrics = self.score(gen)
            metrics.update(merge_round_metrics(metrics, scored_rows, reward_metrics, len(gen)))
            scored_rows += len(gen)
            if not fg.enable:
                return gen, metrics
            group_index = gen.group_indices("uid")
            info = {k.split("/", 1)[1]: gen[k] for k in gen.non_tensor_keys if k.startswith("reward_info/")}
            # Dynamic sampling runs before the KL penalty exists (validation refuses it with KL in the
            # reward), so the final reward of a sequence is its score.
            metric = sequence_metric(fg.metric, token_level_scores=gen["token_level_scores"],
                                     token_level_rewards=gen["token_level_scores"], reward_extra_info=info)
            keep = filter_groups(metric, group_index, uids=gen["uid"])
            batch_kept = gen[keep]
            n_kept = len(set(batch_kept["uid"].tolist()))
            kept.append(batch_kept)
            if state.record(n_kept):
                break
        batch = Batch.concat(with_common_reward_info(kept))
        # Exactly train_batch_size groups: drop the surplus, whole groups at a time.
        uids = list(dict.fromkeys(batch["uid"].tolist()))[:needed]
        batch = batch[np.isin(batch["uid"], uids)]
        metrics["train/num_gen_batches"] = state.num_gen_batches  # verl's DAPO trainer's name
        metrics["dapo/num_prompts_kept"] = state.num_prompts_kept
        return batch, metrics

    def score(self, gen: Batch) -> tuple[Batch, dict[str, Any]]:
        """Each response's score on its last token (`token_level_scores`), and `reward_info/*` columns.
        A reward model in the rollout's processes scores with the engines asleep (`rm_beside_rollout`):
        the sleep is sent first, so the rule scorers run while the engines free their memory, and the
        reward model's calls queue behind it; the next generation wakes them (DAPO's next round too)."""
        rm = self.workers.reward_model
        if rm is None:
            result = self.run.reward_manager.score_batch(gen, self.run.tokenizer)
        else:
            if self.rm_beside_rollout:
                self.rollout_sleep()
            styles = row_styles(gen)
            rule_rows = self.spec.reward_combine.rule_rows(styles)
            rule = self.run.reward_manager.score_batch(gen[rule_rows], self.run.tokenizer) if rule_rows.any() else None
            with self.onloaded(rm, self.spec.reward_model, params_only=True):
                model_inputs = reward_model_inputs(gen, self.run.tokenizer, self.rm_tokenizer)
                model_scores = rm.call_dp(RewardModelRole.compute_rm_score, model_inputs)["rm_scores"]
            result = combine_scores(rule, rule_rows, model_scores, styles, self.spec.reward_combine,
                                    gen["response_mask"])
        gen["token_level_scores"] = result.token_level_scores
        for key, values in result.reward_info.items():
            gen[f"reward_info/{key}"] = np.asarray(values, dtype=object)
        return gen, dict(result.metrics)

    def compute_advantages(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        alg = self.cfg.algorithm
        metrics: dict[str, float] = {}
        mask = batch["response_mask"]
        if alg.use_kl_in_reward:
            rewards, current_kl = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"],
                                                   batch["ref_log_prob"], mask, self.kl_ctrl.value, alg.kl_penalty)
            # verl's names: the coefficient these rewards took (logged before the controller moves it)
            # and their mean KL to the reference
            metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value
            self.kl_ctrl.update(current_kl, n_steps=len(batch))
            metrics["actor/reward_kl_penalty"] = current_kl
        else:
            rewards = batch["token_level_scores"]
        batch["token_level_rewards"] = rewards
        inputs = AdvantageInputs(
            token_level_rewards=rewards,
            response_mask=mask,
            group_index=batch.group_indices("uid"),
            values=batch["values"] if "values" in batch else None,
            baseline_rewards=self.remax_baseline(batch) if alg.adv_estimator == "remax" else None,
            uids=batch["uid"],
        )
        settings = AdvantageSettings(gamma=alg.gamma, lam=alg.lam, norm_adv_by_std=alg.norm_adv_by_std_in_grpo,
                                     pass_k=alg.pass_k)
        advantages, returns = self.estimator(inputs, settings)
        batch["advantages"] = advantages
        batch["returns"] = returns
        return batch, metrics

    def rollout_mismatch(self, batch: Batch, trainer_log_probs: torch.Tensor, step: int) -> dict[str, float]:
        """How far the rollout engine's log-probs are from the trainer's (B, R) for the same tokens and
        weights (a weight-sync or numerics problem shows here first): `training/rollout_logprob_abs_diff_*`,
        `training/rollout_probs_diff_*`, `rollout_corr/*`. Stops the run above `rollout.max_logprob_gap`;
        in a partial rollout's batch, over the tokens sampled with the weights being trained
        (`async/fresh_tokens_logprob_abs_diff_*`, `async/fresh_tokens_probs_diff_*`)."""
        if "rollout_log_probs" not in batch:
            return {}
        metrics = rollout_mismatch_metrics(trainer_log_probs, batch["rollout_log_probs"], batch["response_mask"],
                                           self.spec.actor.loss.rollout_correction)
        # A batch generated with older weights (pipelined modes) differs by the updates since: the gap
        # check of the weight sync applies to batches generated with the weights being trained.
        fresh = "rollout_weights_version" not in batch or bool(
            (batch["rollout_weights_version"] == self.step_version).all())
        # Under sampling filters (or raw log-probs at a temperature) the gap measures the sampling: metrics only.
        threshold = self.spec.max_logprob_gap if self.spec.logprob_gap_uncheckable is None else None
        if "training/rollout_logprob_abs_diff_mean" in metrics and fresh:
            check_logprob_gap(step, metrics["training/rollout_logprob_abs_diff_mean"], threshold,
                              nonfinite_tokens=metrics.get("training/rollout_logprob_num_nonfinite"))
        elif TOKEN_VERSIONS in batch:  # partial rollout: the tokens sampled after the sync are checked
            tokens = (batch["response_mask"].bool() & (batch[TOKEN_VERSIONS] == self.step_version)
                      & torch.isfinite(trainer_log_probs))  # NaN: rows no first optimizer step held
            gap = logprob_gap(trainer_log_probs, batch["rollout_log_probs"], tokens)
            metrics.update({"async/fresh_tokens_" + k.removeprefix("training/rollout_"): v for k, v in gap.items()})
            if gap:
                check_logprob_gap(step, gap["training/rollout_logprob_abs_diff_mean"], threshold,
                                  "the tokens a partial rollout sampled with the weights being trained")
        return metrics

    def staleness_metrics(self, batch: Batch) -> dict[str, float]:
        """How many weight versions behind the weights being trained each row was generated:
        `async/staleness_{mean,max,min}` (0 in synchronous mode, 1 after one_step_off's first step,
        at most trainer.max_staleness with bounded_staleness)."""
        if "rollout_weights_version" not in batch:
            return {}
        staleness = (self.step_version - batch["rollout_weights_version"]).float()
        return {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
                "async/staleness_min": float(staleness.min())}

    def remax_baseline(self, batch: Batch) -> torch.Tensor:
        """ReMax: the reward of one greedy response per prompt, broadcast to that prompt's samples
        (decoded like the samples but greedy: `rollout.ignore_eos` applies to it too)."""
        first = np.sort(np.unique(batch["uid"], return_index=True)[1])
        rows = batch[torch.as_tensor(first)]
        prompt_len = rows["prompts"].shape[1]
        prompts = Batch.from_dict(
            {"input_ids": rows["prompts"], "attention_mask": rows["attention_mask"][:, :prompt_len]},
            {k: rows[k] for k in ("uid", "data_source", "ground_truth", "extra_info") if k in rows},
        )
        greedy = self.generate(prompts, SamplingParams.make_greedy(
            self.response_length, ignore_eos=self.spec.train_sampling.ignore_eos))
        self.rollout_sleep(after="remax_baseline")
        scored, _ = self.score(greedy)
        by_uid = dict(zip(scored["uid"].tolist(), scored["token_level_scores"].sum(-1).tolist()))
        return torch.tensor([by_uid[u] for u in batch["uid"].tolist()], dtype=torch.float32)

    def validate(self) -> dict[str, float]:
        """Validation metrics of the current weights (generations written when configured)."""
        sampling = self.sampling(self.global_step, validation=True)
        batches = validation_batches(self.run.val_dataset, self.cfg.data.val_batch_size)
        with self.phase("val"):
            metrics, scored = validate(batches, lambda prompts, first: self.generate(
                                           prompts, dataclasses.replace(sampling, row_offset=first)),
                                       lambda gen: self.score(gen)[0], sampling.n)
            self.rollout_sleep(after="val")  # asleep already when a reward model in its processes scored
            self.settle_rollout_sleep()  # a checkpoint or the end of the run may follow
        if self.cfg.trainer.validation_data_dir:
            dump_validation(scored, self.run.tokenizer, self.global_step, self.cfg.trainer.validation_data_dir)
        return metrics

    @property
    def n_devices(self) -> int:
        """Devices of every pool the run holds (`perf/throughput` is per device, as verl's over all
        its GPUs): the actor's and those of a critic, reference, reward-model or rollout pool."""
        return run_devices(self.cfg.resources)
