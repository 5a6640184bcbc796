"""Worker and role classes the cluster tests run inside Ray actors.

These are test workers, not stand-ins for anything: they do real torch.distributed (gloo)
collectives and real torch math. `GridWorker` declares a "tp" split of its ranks itself (ranks
r*tp .. r*tp+tp-1 form data-parallel rank r) so that dispatch can be checked against a DP x TP
layout without building a Megatron model.

The tiny policy (`TinyPolicy`, `TinySampler`) is a bigram language model: logits of the next
token are row `token` of a (V, V) table. It is small enough that the test can recompute every
log-probability with explicit float64 loops.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megarl.cluster.worker import Worker, WorkerContext
from megarl.layout import RankCoord
from megarl.protocol import Batch


class GridWorker(Worker):
    """Data-parallel ranks of `tp` consecutive ranks each; records what every rank received."""

    def __init__(self, context: WorkerContext, tag: str = "", fail_on_rank: int | None = None) -> None:
        super().__init__(context)
        if fail_on_rank == context.rank:
            raise RuntimeError(f"constructor refused on rank {context.rank}")
        self.tag = tag
        self.received_rows: list[int] = []

    def init_distributed(self, backend: str | None = None, layout: Any = None, tp: int = 1,
                         timeout_minutes: int = 10) -> RankCoord:
        if layout is not None:  # Megatron's groups, through the engine's hook in the base class
            return super().init_distributed(backend=backend, layout=layout, timeout_minutes=timeout_minutes)
        super().init_distributed(backend=backend, timeout_minutes=timeout_minutes)
        if self.world_size % tp:
            raise ValueError(f"world {self.world_size} not divisible by tp {tp}")
        info = RankCoord(rank=self.rank, dp_rank=self.rank // tp, dp_size=self.world_size // tp,
                         tp_rank=self.rank % tp, tp_size=tp)
        self.set_rank_coord(info)
        return info

    def environment(self) -> dict[str, str]:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "MEGARL_ROLE",
                "MEGARL_TEST_FLAG", "THP_MEM_ALLOC_ENABLE")
        return {key: os.environ.get(key, "") for key in keys}

    def huge_page_kib_of_a_fresh_tensor(self, mib: int) -> int:
        """How much of this process's anonymous memory is on transparent huge pages (kB, from
        /proc/self/smaps_rollup) more after torch allocates and fills a `mib` MiB tensor."""
        def anon_huge_kib() -> int:
            with open("/proc/self/smaps_rollup") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
        before = anon_huge_kib()
        tensor = torch.ones(mib * 2**18)  # float32: 2**18 elements a MiB
        grown = anon_huge_kib() - before
        del tensor
        return grown

    def all_reduce_sum(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def affine_rows(self, batch: Batch, scale: float, shift: float) -> Batch:
        """y = x * scale + shift on the collect rank; -1 everywhere on the others (never collected)."""
        self.received_rows = batch["row"].tolist()
        info = self.rank_coord()
        y = batch["x"] * scale + shift if info.is_collect_rank else torch.full_like(batch["x"], -1.0)
        return Batch.from_dict({"y": y, "row": batch["row"].clone(),
                                "dp_rank": torch.full((len(batch),), info.dp_rank)})

    def row_count_tensor(self, batch: Batch) -> torch.Tensor:
        return batch["row"] * 10

    def rows_received(self) -> list[int]:
        return self.received_rows

    def sleep_interval(self, seconds: float) -> tuple[float, float]:
        """Sleep and return (start, end) wall-clock times."""
        start = time.time()
        time.sleep(seconds)
        return start, time.time()

    def raise_value_error(self, message: str, only_rank: int) -> int:
        if self.rank == only_rank:
            raise ValueError(f"{message} (from rank {self.rank})")
        return self.rank

    def all_reduce_or_exit(self, dying_rank: int, delay_s: float) -> float:
        """Every rank but `dying_rank` enters an all_reduce that can then never complete."""
        if self.rank == dying_rank:
            time.sleep(delay_s)
            os._exit(3)
        return self.all_reduce_sum(1.0)

    def all_reduce_or_hang(self, absent_rank: int) -> float:
        """`absent_rank` sleeps for a long time instead of joining the all_reduce."""
        if self.rank == absent_rank:
            time.sleep(3600)
        return self.all_reduce_sum(1.0)

    def pid(self) -> int:
        return os.getpid()

    def new_group_all_reduce(self, timeout_s: float) -> float:
        """An all_reduce in a gloo group with a short timeout (for the timeout test)."""
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        tensor = torch.ones(1)
        dist.all_reduce(tensor, group=group)
        return float(tensor.item())


VOCAB = 6


def bigram_table(seed: int) -> torch.Tensor:
    """A (VOCAB, VOCAB) float32 logit table: row t gives the next-token logits after token t."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=generator)


def response_log_probs(table: torch.Tensor, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """(B, R) log-prob of each response token given the previous token (last prompt token first)."""
    previous = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1)
    log_probs = torch.log_softmax(table[previous], dim=-1)
    return log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)


class TinyPolicy:
    """A role: the bigram policy. As "actor" it trains; as "ref" it keeps its initial table."""

    def __init__(self, context: WorkerContext, seed: int, lr: float = 0.5) -> None:
        self.context = context
        self.table = torch.nn.Parameter(bigram_table(seed))
        self.lr = lr
        self.offloaded_copy: torch.Tensor | None = None

    def pid(self) -> int:
        return os.getpid()

    def weights(self) -> torch.Tensor:
        return self.table.detach().clone()

    def compute_log_prob(self, batch: Batch) -> Batch:
        if self.offloaded_copy is not None:
            raise RuntimeError("compute_log_prob called while offloaded")
        with torch.no_grad():
            values = response_log_probs(self.table, batch["prompts"], batch["responses"])
        return Batch.from_dict({"log_probs": values})

    def update(self, batch: Batch) -> float:
        """One SGD step on -mean(advantage * log-prob), gradients averaged over all ranks (gloo)."""
        loss = -(batch["advantages"] * response_log_probs(self.table, batch["prompts"], batch["responses"])).mean()
        self.table.grad = None
        loss.backward()
        dist.all_reduce(self.table.grad)
        self.table.grad /= dist.get_world_size()
        with torch.no_grad():
            self.table -= self.lr * self.table.grad
        return float(loss.detach())

    def offload(self) -> None:
        self.offloaded_copy = self.table.detach().clone()
        self.table.data = torch.empty(0)

    def onload(self) -> None:
        if self.offloaded_copy is not None:
            self.table.data = self.offloaded_copy
            self.offloaded_copy = None

    def is_offloaded(self) -> bool:
        return self.offloaded_copy is not None


class TinySampler:
    """A role: the rollout engine. Samples from its own copy of the actor's weights."""

    def __init__(self, context: WorkerContext, response_length: int) -> None:
        self.context = context
        self.response_length = response_length
        self.table: torch.Tensor | None = None
        self.actor: TinyPolicy | None = None

    def connect_roles(self, roles: dict[str, Any]) -> None:
        self.actor = roles["actor"]

    def pid(self) -> int:
        return os.getpid()

    def sync_weights(self) -> int:
        """Copy the actor's weights (same process: a local copy). Returns the address of the source."""
        assert self.actor is not None
        self.table = self.actor.table.detach().clone()
        return self.actor.table.data_ptr()

    def generate(self, batch: Batch, seed: int) -> Batch:
        """Sample R tokens per prompt; the seed is per row (seed + row id) so DP splitting does not matter."""
        if self.table is None:
            raise RuntimeError("generate called before sync_weights")
        rows = []
        for prompt, row_id in zip(batch["prompts"], batch["row"]):
            generator = torch.Generator().manual_seed(seed + int(row_id))
            token = int(prompt[-1])
            response = []
            for _ in range(self.response_length):
                probs = torch.softmax(self.table[token], dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
                response.append(token)
            rows.append(response)
        responses = torch.tensor(rows, dtype=torch.long)
        log_probs = response_log_probs(self.table, batch["prompts"], responses)
        return Batch.from_dict({"responses": responses, "rollout_log_probs": log_probs})
