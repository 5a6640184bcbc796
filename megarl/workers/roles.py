"""The role objects hosted in SPMD worker processes: actor, reference, rollout, critic, reward model.

With a rollout pool of its own (`resources.rollout_pool`) the rollout engines live in other
processes and receive the weights over a bridge that spans both pools (`megarl.hybrid.bridge`):
`ActorRole.send_weights` on the training ranks meets `RolloutRole.receive_weights` on the rollout
ranks.

A `megarl.cluster.host_worker.HostWorker` builds them as `RoleClass(context, **kwargs)` and the
driver reaches them through `WorkerGroup.for_role(name)`. The hybrid actor process holds
"actor" and "rollout" together, and "ref", "critic" and "reward_model" when they have no pool of
their own, so the rollout engine takes its weights from the actor's engine in the same process
(`RolloutRole.sync_weights`).

Every rank runs every call (SPMD). Data-parallel calls receive this rank's DP shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from megarl.agent.loop import AgentLoop
from megarl.agent.rollout import multi_turn_generate
from megarl.agent.tools import ToolSet
from megarl.convert.engine_load import load_converted_weights
from megarl.data.tokenizer import load_tokenizer
from megarl.cluster.rendezvous import address_and_free_port
from megarl.hybrid.bridge import BridgeReceiver, BridgeSender, ShardLayout
from megarl.hybrid.executor import ExecStats
from megarl.hybrid.sync import WeightSync
from megarl.models.spec import ModelSpec
from megarl.protocol import Batch
from megarl.rewards.model_checkpoint import is_converted, reward_model_spec
from megarl.rollout.base import EngineState, SamplingParams
from megarl.rollout.factory import create_rollout_engine
from megarl.rollout.partial import WeightSignal, advance_rows
from megarl.workers.losses import make_actor_loss, make_critic_loss
from megarl.workers.specs import EngineRoleSpec, RolloutSpec

if TYPE_CHECKING:
    from megarl.megatron.engine import MegatronEngine

logger = logging.getLogger(__name__)

ROLLOUT_BUSY = "rollout_busy_s"  # column of `RolloutRole.generate`: seconds the rank spent generating


def _mean(values: Any) -> float:
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    return float(sum(values) / max(1, len(values)))


def _new_engine(model: ModelSpec, spec: EngineRoleSpec) -> MegatronEngine:
    """A Megatron engine for this rank. Megatron-Core is imported here, in the worker, rather than at
    the top: the driver imports this module for the role classes (their methods name the calls it
    makes) and starts seconds sooner without Megatron-Core."""
    from megarl.megatron.engine import MegatronEngine

    return MegatronEngine(model, spec.layout, spec.engine)


class EngineRole:
    """Shared plumbing of the Megatron-engine roles: engine construction, memory, checkpoints."""

    def __init__(self, context: Any, spec: EngineRoleSpec) -> None:
        self.context = context
        self.spec = spec
        self.engine: MegatronEngine | None = None

    def init_model(self) -> None:
        """Build the Megatron engine on this rank's groups and load the spec's model directory."""
        model = ModelSpec.from_hf_config(self.spec.model_dir, family=self.spec.family)
        self.engine = _new_engine(model, self.spec)
        self.engine.load_hf_weights(self.spec.model_dir)
        if self.spec.offload.any:
            self.offload()

    def offload(self) -> None:
        """Move what the spec's offload flags name to host memory (what is there already stays)."""
        off = self.spec.offload
        if off.any:
            self.engine.offload_to_cpu(params=off.params, grads=off.grads, optimizer=off.optimizer)

    def onload(self, params_only: bool = False) -> None:
        """Bring the offloaded state back: all of it (an update), or the parameters only (a forward
        pass or a weight sync, which never touch the gradients or the optimizer state)."""
        self.engine.onload(("params",) if params_only else None)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The whole engine state on the device for the body, as it was (offloaded or not) after."""
        offloaded = self.engine.offloaded is not None
        if offloaded:
            self.engine.onload()
        try:
            yield
        finally:
            if offloaded:
                self.offload()

    def save_checkpoint(self, path: str) -> None:
        with self.resident():
            self.engine.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        with self.resident():
            self.engine.load_checkpoint(path)

    def _train(self, batch: Batch, loss_fn: Any, **kwargs: Any) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's shard; metrics averaged over optimizer steps."""
        update = self.spec.update
        history = self.engine.train_step(
            batch, loss_fn, mini_batch_size=update.mini_batch_sequences // self.engine.ranks.dp_size,
            epochs=update.epochs, shuffle=update.shuffle, max_response_len=self.spec.max_response_length, **kwargs,
        )
        metrics = {k if "/" in k else f"{self.spec.name}/{k}": _mean(v) for k, v in history.items()}
        # 1: this role's data-parallel gradients were summed through shared memory (resources.cpu_grad_reduce)
        metrics[f"{self.spec.name}/grad_reduce_shared_memory"] = float(self.engine.host_reduced_buckets > 0)
        return metrics


class FirstStepLogProbs:
    """The log-probs an update computes in its first optimizer step, by row of this rank's shard.

    Those rows are scored under the weights the update started from, the weights that generated them:
    the trainer's log-probs the separate old-log-prob pass would have computed. Rows the first step
    does not hold (later mini-batches) or does not run (rows of zero advantage it skips) stay NaN.
    Only the last pipeline stage sees log-probs.
    """

    ROW = "update_row"  # the column that carries each row's index through the micro-batches

    def __init__(self, rows: int, response_len: int, engine: MegatronEngine) -> None:
        self.values = torch.full((rows, response_len), float("nan"))
        self.engine = engine
        self.first_step = int(engine.scheduler.num_steps)

    def __call__(self, micro_batch: dict[str, torch.Tensor], log_probs: torch.Tensor) -> None:
        if int(self.engine.scheduler.num_steps) == self.first_step:
            self.values[micro_batch[self.ROW].cpu()] = log_probs.float().cpu()


@dataclasses.dataclass
class ActorUpdate:
    """What `ActorRole.update_actor` returns on a rank.

    metrics: the update's metrics (`actor/...`).
    log_probs: without the old-log-prob pass (`old_log_prob_source` update or rollout), the first
        optimizer step's log-probs of this rank's rows (B_rank, R) float32, detached, NaN where that
        step held or ran no row (a row of zero advantage it skipped); None with the pass. They come
        back with the update, not in a call of their own: a call fewer per rank and step.
    """

    metrics: dict[str, float]
    log_probs: torch.Tensor | None = None


class ActorRole(EngineRole):
    """The policy being trained."""

    def compute_log_prob(self, batch: Batch) -> Batch:
        """`old_log_probs` and `entropys` (B, R) under the current weights, at the rollout temperature."""
        out = self.engine.compute_log_prob(batch, temperature=self.spec.temperature, calculate_entropy=True)
        return Batch.from_dict({"old_log_probs": out["log_probs"], "entropys": out["entropys"]})

    def update_actor(self, batch: Batch) -> ActorUpdate:
        """PPO epochs over `batch`. Without the old-log-prob pass (`old_log_prob_source` update or
        rollout) the first optimizer step's log-probs come back with the metrics (`ActorUpdate`); with
        `skip_zero_advantage_rows`, rows the update left out are NaN there, as rows of later steps."""
        sink = None
        if self.spec.loss.old_log_prob_source != "recompute":
            sink = FirstStepLogProbs(len(batch), int(batch["responses"].shape[1]), self.engine)
            batch[FirstStepLogProbs.ROW] = torch.arange(len(batch))
        metrics = self._train(batch, make_actor_loss(self.spec.loss, sink), temperature=self.spec.temperature,
                              calculate_entropy=True, skip_zero_advantage=self.spec.loss.skip_zero_advantage_rows)
        return ActorUpdate(metrics, sink.values if sink is not None else None)

    # ---------------------------------------------- weights to a rollout pool of its own
    bridge: BridgeSender | None = None

    def plan_bridge(self, rollout_tp: int, bucket_bytes: int, verify_every: int) -> ShardLayout:
        """Plan this rank's part of the sync to a separate rollout pool; returns what its rollout
        rank (the same rank number there) will receive."""
        self.bridge = BridgeSender(self.engine, rollout_tp, bucket_bytes, verify_every)
        return self.bridge.layout

    def bridge_address(self) -> tuple[str, int]:
        """(this node's IP, a port free on it) for the bridge's store (asked of rank 0)."""
        return address_and_free_port()

    def connect_bridge(self, host: str, port: int, world_size: int) -> None:
        self.bridge.connect(host, port, world_size)

    def send_weights(self) -> dict[str, float]:
        """This rank's weights to its rollout rank (`RolloutRole.receive_weights` runs there)."""
        return self.bridge.send()


class RefRole(EngineRole):
    """The frozen reference policy (KL loss or KL-in-reward)."""

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        out = self.engine.compute_log_prob(batch, temperature=self.spec.temperature)
        return Batch.from_dict({"ref_log_prob": out["log_probs"]})

    def save_checkpoint(self, path: str) -> None:  # frozen: rebuilt from the initial weights on resume
        return None

    def load_checkpoint(self, path: str) -> None:
        return None


class CriticRole(EngineRole):
    """The value model: same trunk as the policy (or its own checkpoint), a scalar head."""

    def compute_values(self, batch: Batch) -> Batch:
        return Batch.from_dict({"values": self.engine.compute_values(batch)})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self._train(batch, make_critic_loss(self.spec.loss))


class RewardModelRole(EngineRole):
    """A frozen reward model: a sequence-classification checkpoint's `score` head read at each
    sequence's last valid token."""

    def init_model(self) -> None:
        """From a HF directory, or from a `megarl convert hf-to-mcore` checkpoint (any layout)."""
        if not is_converted(self.spec.model_dir):
            super().init_model()
            return
        model = reward_model_spec(self.spec.model_dir, self.spec.family)  # the family the checkpoint records
        self.engine = _new_engine(model, self.spec)
        load_converted_weights(self.engine, self.spec.model_dir)
        if self.spec.offload.any:
            self.offload()

    def compute_rm_score(self, batch: Batch) -> Batch:
        """`rm_scores` (B,) float32 for rows of `input_ids`/`attention_mask`/`responses`."""
        return Batch.from_dict({"rm_scores": self.engine.compute_rm_score(batch)})

    def save_checkpoint(self, path: str) -> None:  # frozen: rebuilt from its checkpoint on resume
        return None

    def load_checkpoint(self, path: str) -> None:
        return None


def received_metrics(stats: ExecStats) -> dict[str, float]:
    """A rollout rank's side of a weight sync: bytes received against the minimum, seconds, pieces checked."""
    return {
        "sync/bytes_received": float(stats.bytes_received),
        "sync/bytes_minimum": float(stats.minimum_bytes),
        "sync/seconds": float(stats.seconds),
        "sync/pieces_verified": float(stats.pieces_verified),
    }


class RolloutRole:
    """The rollout engine of this rank, refilled from the actor's weights in the same process."""

    def __init__(self, context: Any, spec: RolloutSpec) -> None:
        self.context = context
        self.spec = spec
        self.engine: Any = None
        self.actor: ActorRole | None = None
        self.weight_sync: WeightSync | None = None
        self.bridge: BridgeReceiver | None = None  # separate placement: the weights come from another pool
        self.weights_version = -1
        self.agent: AgentLoop | None = None  # the multi-turn loop, built on first use
        self.agent_group: Any = None  # the gloo group of this rank's rollout TP group (multi-turn, TP > 1)
        self.weight_signal: WeightSignal | None = None  # partial rollout: the driver's newest weight version

    def connect_roles(self, roles: dict[str, Any]) -> None:
        self.actor = roles.get("actor")

    @property
    def dp_rank(self) -> int:
        """This rank's engine among the rollout's data-parallel engines (one per rollout TP group)."""
        return self.context.rank // self.spec.tensor_parallel_size

    def init_engine(self) -> str:
        """Build the engine (vLLM or HF, per `spec.engine`); returns which and why. The engine's own
        random stream (unseeded calls) is seeded per data-parallel engine: the TP ranks of one vLLM
        engine must draw alike."""
        options = dataclasses.replace(self.spec.options, seed=self.spec.options.seed + self.dp_rank)
        self.engine = create_rollout_engine(self.spec.engine, self.spec.model_dir, options)
        return f"{self.engine.name} ({self.engine.selection_reason})"

    def sync_weights(self, version: int) -> dict[str, float]:
        """Reshard the actor's current weights into the rollout engine (every rank calls this).

        The plan (this rank's own, built once) sends each rank only the bytes of its rollout shard
        it does not hold. `sync/seconds` is this rank's whole sync, `sync/verify_s` the part of it
        spent checking the fingerprints (see `megarl.hybrid.executor.ExecStats.verify_seconds`).
        """
        if self.weight_sync is None:
            self.weight_sync = WeightSync(self.actor.engine, self.engine, rollout_tp=self.spec.tensor_parallel_size,
                                          bucket_bytes=self.spec.sync_bucket_bytes,
                                          verify_every=self.spec.sync_verify_freq)
        stats = self.weight_sync.sync()
        self.weights_version = version
        # pieces_verified: in the whole world, the same on every rank; verify_s: checking the
        # fingerprints after the transfers (exchange, compare, all-reduce), 0 unverified.
        return {**received_metrics(stats), "sync/bytes_sent": float(stats.bytes_sent),
                "sync/verify_s": float(stats.verify_seconds)}

    def connect_bridge(self, host: str, port: int, world_size: int, layout: ShardLayout) -> None:
        """Join the bridge to the training pool (separate placement); `layout`: what this rank
        receives, as its training rank planned it."""
        self.bridge = BridgeReceiver(self.engine, self.context.rank, layout, self.spec.sync_bucket_bytes,
                                     self.spec.sync_verify_freq)
        self.bridge.connect(host, port, world_size)

    def receive_weights(self, version: int) -> dict[str, float]:
        """Take the training rank's weights over the bridge (separate placement); the same metrics
        as `sync_weights`, bytes counted at this end (the rollout pool)."""
        stats = self.bridge.receive()
        self.weights_version = version
        return received_metrics(stats)  # pieces_verified: this rank's (the check is inline, per bucket)

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Responses to this rank's prompts: one engine call, or with `spec.multi_turn` the agent
        loop (turns and tool calls; the rollout TP group's first rank drives it and runs the tools)."""
        start = time.perf_counter()
        if self.spec.multi_turn is None:
            out = self.engine.generate(prompts, self._rows_of_shard(prompts, sampling))
        else:  # the agent loop calls the engine with n=1, one context per episode (n per prompt)
            out = multi_turn_generate(self._agent_loop(), prompts, self._rows_of_shard(prompts, sampling, sampling.n),
                                      driver=self._leads_rollout_group(), share=self._share_in_rollout_group)
        if not self.spec.calculate_log_probs and "rollout_log_probs" in out:
            out.pop("rollout_log_probs")
        # How long this rank generated, on every row (the driver takes it off: async/rollout_busy_s).
        out[ROLLOUT_BUSY] = torch.full((len(out),), time.perf_counter() - start, dtype=torch.float64)
        return out

    def connect_weight_signal(self, host: str, port: int) -> None:
        """Partial rollout: read the driver's newest weight version between chunks (rank 0 of each
        rollout TP group reads it and tells the others)."""
        if self._leads_rollout_group():
            self.weight_signal = WeightSignal.connect(host, port)

    def generate_partial(self, rows: Batch, sampling: SamplingParams, version: int,
                         interrupt_above: int | None) -> Batch:
        """Go on generating this rank's open rows (`megarl.rollout.partial`) with the weights of
        `version`, chunk by chunk. `interrupt_above`: stop after a chunk once the driver's weight
        signal exceeds it, or after `spec.partial.interrupt_after` chunks when that is set; None:
        run every row to its end."""
        start = time.perf_counter()
        settings = self.spec.partial

        def interrupted(chunks: int) -> bool:
            if interrupt_above is None:
                return False
            if settings.interrupt_after is not None:
                return chunks >= settings.interrupt_after
            newer = self.weight_signal.newest() > interrupt_above if self.weight_signal is not None else False
            return bool(self._share_in_rollout_group(newer))  # the ranks of one engine stop together

        out = advance_rows(self.engine, rows, self._rows_of_shard(rows, sampling), version, settings.chunk_tokens,
                           interrupted, restart_stale=settings.mode == "drop")
        out[ROLLOUT_BUSY] = torch.full((len(out),), time.perf_counter() - start, dtype=torch.float64)
        return out

    def probe(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """One engine call on this rank's probe prompts (`rollout.probe_freq`), with the sampled tokens'
        log-probs whatever `calculate_log_probs` and `multi_turn` say: the weight-sync probe compares them
        with the actor's."""
        return self.engine.generate(prompts, self._rows_of_shard(prompts, sampling))

    def _rows_of_shard(self, shard: Batch, sampling: SamplingParams, per_row: int = 1) -> SamplingParams:
        """`sampling` for this rank's DP shard: its rows counted from the shard's first row in the whole
        batch (`SamplingParams.row_offset`: given in prompts, returned in units of `per_row` engine
        requests a shard row, so a multi-turn episode j of prompt i is request (row_offset + i) x n + j,
        as a single-turn row). `call_dp` gives every rank an equal run of consecutive rows, so the shard
        of DP rank d starts at row d x len(shard): a seeded row then samples from streams of its own on
        whichever rank it lands, and (one engine call per shard) the same streams whatever the split."""
        offset = (sampling.row_offset + self.dp_rank * len(shard)) * per_row
        return dataclasses.replace(sampling, row_offset=offset)

    def _agent_loop(self) -> AgentLoop:
        if self.agent is None:
            settings = self.spec.multi_turn
            self.agent = AgentLoop(self.engine, load_tokenizer(self.spec.model_dir),
                                   ToolSet.from_names(settings.tools, settings.tool_timeout_s), settings)
        return self.agent

    def _leads_rollout_group(self) -> bool:
        """The first rank of this rank's rollout TP group (it drives the agent loop, reads the weight signal)."""
        return self.context.rank % self.spec.tensor_parallel_size == 0

    def _share_in_rollout_group(self, obj: Any) -> Any:
        """The driving rank's `obj` on every rank of this rollout TP group (identity at TP=1)."""
        if self.spec.tensor_parallel_size == 1:
            return obj
        if self.agent_group is None:  # every rank creates every group, in the same order
            tp, world = self.spec.tensor_parallel_size, torch.distributed.get_world_size()
            groups = [torch.distributed.new_group(list(range(s, s + tp)), backend="gloo") for s in range(0, world, tp)]
            self.agent_group = groups[self.context.rank // tp]
        holder = [obj]
        src = self.context.rank - self.context.rank % self.spec.tensor_parallel_size
        torch.distributed.broadcast_object_list(holder, src=src, group=self.agent_group)
        return holder[0]

    def sleep(self) -> bool:
        """Release the KV cache and the weight copy until the next sync (`spec.free_cache_engine`).
        Returns whether the weights are lost (a sync must follow the next wake-up)."""
        if self.spec.free_cache_engine and self.engine.state is not EngineState.ASLEEP:
            self.engine.sleep()
            return self.engine.sleep_discards_weights
        return False

    def wake_up(self, tags: tuple[str, ...] | None = None) -> bool:
        """Restore what `sleep` released: everything, or only `("weights",)` (before a weight sync,
        so the KV cache is allocated after the sync's buffers are gone). Returns whether it woke."""
        if self.engine.state is EngineState.AWAKE:
            return False
        self.engine.wake_up(tags)
        return True


def set_torch_threads(n: int) -> int:
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()
