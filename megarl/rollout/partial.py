"""Partial rollout (`trainer.partial_rollout`): a generation that goes on across a weight update.

In the pipelined modes (`trainer.async_mode`) the next step's rows are generated while the current
step trains. With partial rollout that generation is checked every `chunk_tokens` tokens
(`RolloutEngine.generate_interruptible`: the HF engine checks inside its decoding loop, other
engines generate chunks through their token-in, token-out call), and it stops when newer weights
wait: as soon as the driver has raised the weight signal after the update
(`WeightSignal`), or, with `interrupt_after` set, after that many chunks whatever the timing (the
reproducible schedule of tests and benchmarks). The driver then syncs the weights and hands the
same rows back: `continue` goes on from the tokens already sampled (the KV cache is rebuilt with the
new weights), `drop` samples the unfinished rows again from their prompts. Every token records the
weight version it was sampled with, and its log-prob is the one of that version (the behaviour
policy the off-policy correction weights against).

Columns of a partial rollout batch besides those of `megarl.rollout.output`:
- `rollout_token_versions` (N, R) int64: the weight version of each response token, -1 on padding;
- `partial_open` (N,) int64: 1 while a row is unfinished (no stop token and fewer than R tokens).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megarl.protocol import Batch
from megarl.rollout.base import SamplingParams
from megarl.rollout.output import assemble_rollout_batch, pad_responses, unpad_prompts

TOKEN_VERSIONS = "rollout_token_versions"
OPEN = "partial_open"


@dataclass(frozen=True)
class PartialRollout:
    """`trainer.partial_rollout*`: what happens to an unfinished row when new weights arrive
    (`mode`), tokens per chunk, and the fixed interruption point (None: when the signal rises)."""

    mode: str = "continue"
    chunk_tokens: int = 16
    interrupt_after: Optional[int] = None


def open_rows(prompts: Batch, n: int, response_length: int, pad_token_id: int) -> Batch:
    """`n` rows per prompt with empty responses, all open: the start of a partial rollout."""
    rows = len(prompts) * n
    empty = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    out = assemble_rollout_batch(prompts, empty, torch.zeros(rows, dtype=torch.long),
                                 torch.zeros(empty.shape, dtype=torch.float32), n, pad_token_id)
    out[TOKEN_VERSIONS] = torch.full(empty.shape, -1, dtype=torch.long)
    out[OPEN] = torch.ones(rows, dtype=torch.long)
    return out


def call_seed(seed: Optional[int], version: int) -> Optional[int]:
    """The seed of the call that generates with weights `version`: the continuation after a sync
    must not draw the random numbers the interrupted call drew."""
    return None if seed is None else seed + 1_000_003 * (version + 1)


def advance_rows(engine: Any, rows: Batch, params: SamplingParams, version: int, chunk_tokens: int,
                 interrupted: Callable[[int], bool], restart_stale: bool = False) -> Batch:
    """Generate the open rows of `rows` with the engine's current weights (`version`) until every
    row is finished or, checked after every `chunk_tokens` tokens, `interrupted(checks_done)` is
    true (`RolloutEngine.generate_interruptible`). With `restart_stale`, an open row holding tokens
    of another version starts again from its prompt (`drop`). Returns a copy of `rows` with the new
    tokens."""
    width = rows["responses"].shape[1]
    prompt_width = rows["prompts"].shape[1]
    prompts = unpad_prompts(rows["prompts"], rows["attention_mask"][:, :prompt_width])
    lengths = rows["response_mask"].sum(-1).tolist()
    tokens = [rows["responses"][i, :k].tolist() for i, k in enumerate(lengths)]
    log_probs = [rows["rollout_log_probs"][i, :k].tolist() for i, k in enumerate(lengths)]
    versions = [rows[TOKEN_VERSIONS][i, :k].tolist() for i, k in enumerate(lengths)]
    open_ = [bool(x) for x in rows[OPEN].tolist()]
    for i in range(len(rows)):
        if open_[i] and restart_stale and any(v != version for v in versions[i]):
            tokens[i], log_probs[i], versions[i] = [], [], []
    todo = [i for i, o in enumerate(open_) if o]
    # Each open row keeps its own random stream (its index in the whole batch), whichever rows closed.
    one = params.for_prompts(len(rows), todo, n=1, seed=call_seed(params.seed, version))
    continued = engine.generate_interruptible([prompts[i] + tokens[i] for i in todo], one,
                                              [width - len(tokens[i]) for i in todo], chunk_tokens, interrupted)
    for i, new in zip(todo, continued):
        tokens[i] += new.token_ids
        log_probs[i] += new.log_probs
        versions[i] += [version] * len(new.token_ids)
        open_[i] = not new.stopped and len(tokens[i]) < width

    responses, probs, kept = pad_responses(tokens, log_probs, width, engine.options.pad_token_id)
    mask = (torch.arange(width).unsqueeze(0) < kept.unsqueeze(1)).long()
    token_versions = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, v in enumerate(versions):
        token_versions[i, :len(v)] = torch.as_tensor(v, dtype=torch.long)
    rows = rows.select(*rows.keys())  # the caller's batch stays as it was
    rows["responses"] = responses
    rows["response_mask"] = mask
    rows["rollout_log_probs"] = probs
    rows["input_ids"] = torch.cat([rows["prompts"], responses], dim=1)
    rows["attention_mask"] = torch.cat([rows["attention_mask"][:, :prompt_width], mask], dim=1)
    rows[TOKEN_VERSIONS] = token_versions
    rows[OPEN] = torch.tensor(open_, dtype=torch.long)
    return rows


def partial_metrics(batch: Batch, trained_with: int) -> dict[str, float]:
    """Per-token staleness (`async/token_staleness_{mean,max}`: versions between a token's weights
    and those it is trained from) and the share of rows sampled under more than one version
    (`async/partial_rows`). Empty for a batch without per-token versions."""
    if TOKEN_VERSIONS not in batch:
        return {}
    versions, mask = batch[TOKEN_VERSIONS], batch["response_mask"].bool()
    staleness = (trained_with - versions)[mask].float()
    newest = versions.masked_fill(~mask, -1).max(-1).values  # -1 for an empty row, as its oldest
    return {"async/token_staleness_mean": float(staleness.mean()) if staleness.numel() else 0.0,
            "async/token_staleness_max": float(staleness.max()) if staleness.numel() else 0.0,
            "async/partial_rows": float((newest != oldest_versions(batch)).float().mean())}


def oldest_versions(batch: Batch) -> torch.Tensor:
    """(N,) the oldest weight version among each row's tokens (a row's staleness is its oldest
    token's); rows without a token keep -1."""
    versions, mask = batch[TOKEN_VERSIONS], batch["response_mask"].bool()
    oldest = versions.masked_fill(~mask, 2**62).min(-1).values
    return torch.where(mask.any(-1), oldest, torch.full_like(oldest, -1))


class WeightSignal:
    """The driver's word to the rollout ranks that newer weights exist: a counter in a TCP store the
    driver serves (`serve`), read by each rollout rank between two chunks (`connect`; one round trip,
    about 50 us on one host). Its value is the newest weight version the actor has."""

    KEY = "megarl/newest_weights_version"
    TIMEOUT = datetime.timedelta(seconds=60)

    def __init__(self, store: dist.TCPStore, host: str) -> None:
        self.store = store
        self.host = host
        self.value = 0

    @classmethod
    def serve(cls, host: str) -> WeightSignal:
        return cls(dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=cls.TIMEOUT), host)

    @classmethod
    def connect(cls, host: str, port: int) -> WeightSignal:
        return cls(dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=cls.TIMEOUT), host)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, int(self.store.port)

    def raise_to(self, version: int) -> None:
        """Announce weight version `version` (never lowers the value)."""
        if version > self.value:
            self.store.add(self.KEY, version - self.value)
            self.value = version

    def newest(self) -> int:
        return int(self.store.add(self.KEY, 0))
