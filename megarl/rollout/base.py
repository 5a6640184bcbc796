"""The rollout engine interface: sampling parameters, engine options and the engine contract.

Every engine takes a prompt ``Batch`` (left-padded ``input_ids`` (B, P) + ``attention_mask``) and
returns a ``Batch`` of B * n rows (the n samples of prompt i are rows i*n .. i*n+n-1) with the
columns listed in :mod:`megarl.rollout.output`.

Log-prob convention (``rollout_log_probs``), the same as verl's default vLLM setting
(``logprobs_mode="processed_logprobs"``): the log-probability of the sampled token under the
distribution it was drawn from, i.e. ``log_softmax(logits / temperature)`` after top-k / top-p
filtering and renormalisation. For greedy decoding the temperature counts as 1 and no filter is
applied, so the value is ``log_softmax(logits)``. With top_k / top_p off this is exactly what a
trainer recomputes as ``log_softmax(logits / temperature)``; with them on, the trainer's value
differs on purpose (it sees the unfiltered policy). ``logprobs_mode="raw"`` returns
``log_softmax(logits)`` (temperature and filters ignored), vLLM's ``raw_logprobs``.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.dtypes import long_name, torch_dtype
from megarl.errors import ConfigError, MegarlError
from megarl.protocol import Batch

LOGPROBS_MODES = ("processed", "raw")


class RolloutStateError(MegarlError, RuntimeError):
    """An engine was used in a state that does not allow it (asleep, released)."""


class WeightUpdateError(MegarlError, ValueError):
    """A weight update named an unknown parameter or had the wrong shape or dtype."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses.

    Attributes:
        n: samples per prompt (>= 1).
        temperature: softmax temperature (> 0 unless ``greedy``).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; -1 or 0 disables it.
        max_new_tokens: response length R; outputs are right-padded to exactly R.
        stop_token_ids: tokens that end a response besides the engine's EOS ids (kept in the
            response and in ``response_mask``).
        seed: when set, the same prompts, params and weights give the same samples; when None the
            engine's own random stream (seeded at construction) continues. Response row r of the
            whole batch samples from a stream of its own, `megarl.rollout.seeds.row_seed(seed, r)`:
            rows, samples of a prompt, ranks and calls with other seeds never share one.
        row_offset: the index of this call's first prompt in the whole batch when the batch is
            split over several engines (data-parallel ranks): prompt i's samples are rows
            (row_offset + i) * n + c of the batch, so each rank draws its own random numbers and
            a seeded batch samples the same whatever its split.
        prompt_indices: each prompt's index in the whole batch (counted as `row_offset` counts),
            where they are not row_offset, row_offset + 1, ...: a call that continues only some
            requests (an agent loop's later turns, a partial rollout's open rows) keeps each one on
            its own random stream. Replaces `row_offset` when set; see `batch_indices`.
        greedy: argmax decoding (validation); temperature/top_p/top_k are then ignored.
        ignore_eos: keep generating after EOS / stop tokens (benchmarks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    greedy: bool = False
    ignore_eos: bool = False
    row_offset: int = 0
    prompt_indices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.prompt_indices is not None:
            object.__setattr__(self, "prompt_indices", tuple(int(i) for i in self.prompt_indices))
            if any(i < 0 for i in self.prompt_indices):
                raise ConfigError(f"SamplingParams.prompt_indices must be >= 0, got {list(self.prompt_indices)}")
        if self.n < 1:
            raise ConfigError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.row_offset < 0:
            raise ConfigError(f"SamplingParams.row_offset must be >= 0, got {self.row_offset}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ConfigError(
                f"SamplingParams.temperature must be > 0 for sampling, got {self.temperature}; "
                "use SamplingParams.make_greedy() for argmax decoding"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"SamplingParams.top_k must be -1, 0 (off) or positive, got {self.top_k}")

    def batch_indices(self, count: int) -> list[int]:
        """The index in the whole batch of each of a call's `count` prompts: `prompt_indices`, or
        `row_offset`, `row_offset` + 1, ... (prompt i's c-th sample is response row index x n + c)."""
        if self.prompt_indices is None:
            return list(range(self.row_offset, self.row_offset + count))
        if len(self.prompt_indices) != count:
            raise ValueError(f"SamplingParams.prompt_indices names {len(self.prompt_indices)} prompts, "
                             f"the call has {count}")
        return list(self.prompt_indices)

    def for_prompts(self, count: int, chosen: Sequence[int], **changes: Any) -> SamplingParams:
        """These params (for a call on `count` prompts) for a call on the prompts at places `chosen`
        of them, each keeping its index in the whole batch, with `changes` applied."""
        indices = self.batch_indices(count)
        return dataclasses.replace(self, prompt_indices=tuple(indices[i] for i in chosen), **changes)

    @classmethod
    def make_greedy(cls, max_new_tokens: int, n: int = 1, **kwargs: Any) -> SamplingParams:
        """Argmax decoding, for validation."""
        return cls(n=n, max_new_tokens=max_new_tokens, greedy=True, **kwargs)

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


@dataclass
class EngineOptions:
    """Options an engine is built with (fields named like ``rollout.*`` in the experiment config).

    Attributes:
        pad_token_id: id written into padded response positions.
        eos_token_ids: ids that end a response: the tokenizer's EOS and the model's
            `generation_config.json` `eos_token_id`s (end-of-turn ids such as Llama-3's
            <|eot_id|> or Qwen2.5's <|im_end|>), see `megarl.trainer.cli.eos_token_ids`.
        dtype: "float32", "bfloat16" or "float16" (or fp32 / bf16 / fp16): weights and compute.
        seed: the engine's random stream seed (calls without `SamplingParams.seed`).
        tensor_parallel_size: vLLM tensor-parallel ranks (the HF engine needs 1).
        logprobs_mode: "processed" (verl's default, see module doc) or "raw".
        max_model_len: longest prompt + response the engine must hold (None: model config).
        max_num_seqs: sequences scheduled at once (vLLM).
        kv_cache_memory_gb: KV-cache size on CPU (vLLM CPU build).
        gpu_memory_utilization: fraction of GPU memory for vLLM.
        enforce_eager: no CUDA graphs (vLLM on GPU).
        enable_sleep_mode: let vLLM free its KV cache / weights between rollouts where supported.
        sleep_level: what ``sleep`` does with the weights (the KV cache is always freed).
            1: keep them, in host memory when they live on an accelerator, so a wake-up restores
            them unchanged (on CPU the HF engine keeps them where they are: nothing is freed).
            2 (default): discard them; ``wake_up`` re-allocates them with undefined contents and
            the engine refuses to generate until a weight sync has rewritten every weight
            (``update_weights`` naming all of them, or in-place copies + ``mark_weights_updated``).
            The hybrid engine rewrites the weights before every rollout anyway, so 2 saves a
            host copy of the model. vLLM applies it only where its sleep mode is available.
        extra: passed through to the engine constructor (``vllm.LLM(**extra)``).
    """

    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    dtype: str = "float32"
    seed: int = 0
    tensor_parallel_size: int = 1
    logprobs_mode: str = "processed"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    enable_sleep_mode: bool = True
    sleep_level: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        self.dtype = long_name(self.dtype, "rollout dtype")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"rollout logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"rollout tensor_model_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.sleep_level not in (1, 2):
            raise ConfigError(
                f"rollout sleep_level must be 1 or 2, got {self.sleep_level!r} "
                "(1: keep the weights while asleep, 2: discard them until the next weight sync)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


def token_budgets(contexts: Sequence[Sequence[int]], params: SamplingParams,
                  max_new_tokens: Sequence[int] | None) -> list[int]:
    """The token budget of each context of a `generate_tokens` call (default `params.max_new_tokens`)."""
    budgets = [params.max_new_tokens] * len(contexts) if max_new_tokens is None else [int(b) for b in max_new_tokens]
    if len(budgets) != len(contexts) or any(b < 1 for b in budgets):
        raise ValueError(f"generate_tokens: need one budget >= 1 per context, got {budgets} for {len(contexts)}")
    return budgets


@dataclass
class TokenContinuation:
    """One request's new tokens from ``generate_tokens``: ids as sampled, (len,) log-probs, and
    whether the turn ended on an EOS/stop token (False: it ran out of its token budget)."""

    token_ids: list[int]
    log_probs: list[float]
    stopped: bool


class EngineState(enum.Enum):
    """Lifecycle of an engine: what it holds in memory right now."""

    AWAKE = "awake"  # weights and KV cache: generate and update_weights allowed
    WEIGHTS_ONLY = "weights_only"  # weights resident, no KV cache: update_weights allowed
    ASLEEP = "asleep"  # neither: only wake_up / release allowed
    RELEASED = "released"  # gone for good


WAKE_TAGS = ("weights", "kv_cache")


class RolloutEngine(abc.ABC):
    """A generator of responses that the trainer can refill with new weights.

    One engine lives in each worker process (SPMD): with tensor parallelism each worker rank holds
    one tensor-parallel rank of the engine, so weights move by memory copy.

    State machine: AWAKE --sleep()--> ASLEEP --wake_up(("weights",))--> WEIGHTS_ONLY
    --wake_up()--> AWAKE; ``generate`` needs AWAKE, ``update_weights`` needs AWAKE or WEIGHTS_ONLY,
    ``release()`` ends the engine. When ``sleep_discards_weights``, waking the weights re-allocates
    them with undefined contents and ``needs_weight_sync`` stays True, refusing ``generate``, until
    a weight sync has rewritten all of them. Misuse raises :class:`RolloutStateError`.
    """

    name: str = "base"
    selection_reason: str = "constructed directly"

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self._state = EngineState.AWAKE
        self._weights_discarded = False  # woken after a discarding sleep, not yet rewritten

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def sleep_frees_memory(self) -> bool:
        """Whether ``sleep`` really frees memory here (False: it only changes the state)."""
        return False

    @property
    def sleep_discards_weights(self) -> bool:
        """Whether ``sleep`` loses the weights here (``sleep_level`` 2 where the engine can free
        them), so a weight sync must follow every wake-up before ``generate``."""
        return False

    @property
    def needs_weight_sync(self) -> bool:
        """True from a wake-up that re-allocated discarded weights until they are all rewritten."""
        return self._weights_discarded

    # -- the contract ---------------------------------------------------------------------------
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses for each prompt.

        Args:
            prompts: a ``Batch`` with ``input_ids`` (B, P) int64, left-padded, and
                ``attention_mask`` (B, P); optional ``position_ids`` and any non-tensor columns.
        Returns:
            a ``Batch`` of B * n rows; see :func:`megarl.rollout.output.assemble_rollout_batch`.
        """
        self._require_generate()
        return self._generate(prompts, params)

    def generate_tokens(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, max_new_tokens: Sequence[int] | None = None
    ) -> list[TokenContinuation]:
        """Continue each token list by one sample: the token-in, token-out call of multi-turn rollouts.

        Args:
            contexts: the full token ids of each request so far (prompt, earlier turns, tool outputs).
            params: sampling (``n`` is ignored: one continuation per context).
            max_new_tokens: a budget per context (default ``params.max_new_tokens`` for all).
        Returns:
            one :class:`TokenContinuation` per context, in order: the ids exactly as sampled, their
            log-probs, and whether the turn ended on an EOS/stop token (else on the budget).
        """
        budgets = token_budgets(contexts, params, max_new_tokens)
        if not contexts:
            return []
        one = dataclasses.replace(params, n=1, max_new_tokens=max(budgets))
        return self._continuations(self.generate(self._context_batch(contexts), one), params, budgets)

    def generate_interruptible(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, max_new_tokens: Sequence[int],
        every: int, interrupted: Callable[[int], bool],
    ) -> list[TokenContinuation]:
        """`generate_tokens`, but after every `every` new tokens `interrupted(checks_done)` may stop
        it: the requests not finished by then come back with the tokens they have (`stopped`
        False), to be continued later, maybe with other weights (partial rollout).

        This default generates chunks of `every` tokens through `generate_tokens`, each chunk
        prefilling its context again and sampling with a seed of its own (`params.seed` + 7919 x
        chunk index); the HF engine stops its decoding loop instead, keeping its KV cache between checks.
        """
        budgets = token_budgets(contexts, params, max_new_tokens)
        tokens: list[list[int]] = [[] for _ in contexts]
        log_probs: list[list[float]] = [[] for _ in contexts]
        stopped = [False] * len(contexts)
        checks = 0
        while True:
            todo = [i for i in range(len(contexts)) if not stopped[i] and len(tokens[i]) < budgets[i]]
            if not todo:
                break
            chunk = params.for_prompts(len(contexts), todo,
                                       seed=None if params.seed is None else params.seed + 7_919 * checks)
            new = self.generate_tokens([list(contexts[i]) + tokens[i] for i in todo], chunk,
                                       [min(every, budgets[i] - len(tokens[i])) for i in todo])
            for i, cont in zip(todo, new):
                tokens[i] += cont.token_ids
                log_probs[i] += cont.log_probs
                stopped[i] = cont.stopped
            checks += 1
            if any(not stopped[i] and len(tokens[i]) < budgets[i] for i in todo) and interrupted(checks):
                break
        return [TokenContinuation(t, lp, s) for t, lp, s in zip(tokens, log_probs, stopped)]

    def _context_batch(self, contexts: Sequence[Sequence[int]]) -> Batch:
        """Token lists as a left-padded prompt batch."""
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.options.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context):] = torch.as_tensor(list(context), dtype=torch.long)
            mask[row, width - len(context):] = 1
        return Batch.from_dict({"input_ids": ids, "attention_mask": mask})

    def _continuations(self, out: Batch, params: SamplingParams, budgets: Sequence[int]) -> list[TokenContinuation]:
        """The rows of a one-sample-per-context rollout batch as continuations, cut to their budgets."""
        stops = set(self.options.eos_token_ids) | set(params.stop_token_ids)
        lengths = out["response_mask"].sum(-1).tolist()
        log_probs = out["rollout_log_probs"]
        result = []
        for row, budget in enumerate(budgets):
            k = min(int(lengths[row]), budget)
            tokens = out["responses"][row, :k].tolist()
            result.append(TokenContinuation(tokens, log_probs[row, :k].tolist(),
                                            stopped=bool(tokens) and tokens[-1] in stops and not params.ignore_eos))
        return result

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights into the engine in place; returns the number of tensors loaded.

        Names are HuggingFace parameter names (``model.layers.0.self_attn.q_proj.weight``) and
        tensors are full (unsharded) HF tensors; a tensor-parallel vLLM engine slices its own shard
        from them. Every name must be known and every shape must match, else
        :class:`WeightUpdateError` names the parameter. Parameters not named keep their values;
        after a discarding sleep the engine generates again once every weight has been named
        (over one or several calls).
        """
        self._require_weights("update weights")
        loaded = self._update_weights(named_tensors)
        self._settle_discarded()
        return loaded

    def weight_targets(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | None:
        """The engine's own tensors under these HF names (full tensors of these shapes), for a weight
        sync to write in place instead of handing new tensors to ``update_weights``; then
        ``weights_written`` counts them as rewritten. None (the default): the engine takes weights
        only through ``update_weights`` (vLLM's loaders fuse q/k/v and gate/up and shard them).
        Names and shapes are checked as ``update_weights`` checks them."""
        return None

    def weights_written(self, names: Iterable[str]) -> None:
        """After writing into ``weight_targets(...)``: these names count as rewritten, as if given to
        ``update_weights``."""
        self._require_weights("update weights")
        for name in names:
            self._note_written(name)
        self._settle_discarded()

    def _settle_discarded(self) -> None:
        """After an update: a discarded model counts as whole again once no weight is missing."""
        if self._weights_discarded and not self._missing_weights():
            self._weights_discarded = False

    def sleep(self) -> None:
        """Free the KV cache and, per ``options.sleep_level``, move the weights to host memory (1)
        or discard them (2) until ``wake_up``."""
        self._require_not_released("sleep")
        if self._state is EngineState.ASLEEP:
            return
        self._sleep()
        self._state = EngineState.ASLEEP

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what ``sleep`` freed: ``tags`` None = everything, or a subset of
        ("weights", "kv_cache") to wake weights first (update them) and the cache after."""
        self._require_not_released("wake_up")
        wanted = set(WAKE_TAGS if tags is None else tags)
        unknown = wanted - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be a subset of {WAKE_TAGS}, got {sorted(unknown)}")
        if "kv_cache" in wanted and "weights" not in wanted and self._state is EngineState.ASLEEP:
            raise RolloutStateError("wake up the weights before (or together with) the KV cache")
        if self._state is EngineState.AWAKE:
            return
        woken = tuple(t for t in WAKE_TAGS if t in wanted and not self._holds(t))
        self._wake_up(woken)
        if "weights" in woken and self.sleep_discards_weights:
            self._weights_discarded = True
        self._state = EngineState.AWAKE if "kv_cache" in wanted else EngineState.WEIGHTS_ONLY

    def release(self) -> None:
        """Free everything; the engine cannot be used afterwards."""
        if self._state is EngineState.RELEASED:
            return
        self._release()
        self._state = EngineState.RELEASED

    @abc.abstractmethod
    def engine_model(self) -> torch.nn.Module:
        """The model object the engine runs, for in-place copies by a resharding step: its
        parameter names and layouts are the engine's own (vLLM fuses ``qkv_proj`` and
        ``gate_up_proj``) and with tensor parallelism it holds only this rank's shards."""

    def mark_weights_damaged(self) -> None:
        """Call when an in-place copy into ``engine_model()`` failed part-way (a verified sync found
        a changed bucket after writing it): the engine refuses to generate, as after a discarding
        sleep, until an update names every weight or ``mark_weights_updated`` follows a whole copy."""
        self._weights_discarded = True
        self._expect_every_weight()

    def mark_weights_updated(self) -> None:
        """Call after copying into ``engine_model()`` parameters directly (not through
        ``update_weights``): every weight counts as rewritten, and anything the engine computed
        with the old weights is dropped."""
        self._weights_discarded = False
        self._weights_rewritten()

    # -- engine-specific parts ------------------------------------------------------------------
    @abc.abstractmethod
    def _generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    @abc.abstractmethod
    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int: ...

    def _sleep(self) -> None:
        """Free memory (default: nothing to free)."""

    def _wake_up(self, tags: tuple[str, ...]) -> None:
        """Restore the parts named in ``tags`` (default: nothing was freed)."""

    def _release(self) -> None:
        """Free everything (default: nothing held outside Python objects)."""

    def _weights_rewritten(self) -> None:
        """Forget what was computed with the old weights (default: nothing is kept)."""

    def _note_written(self, name: str) -> None:
        """Count the update name `name` as rewritten (default: the engine does not track names)."""

    def _missing_weights(self) -> list[str]:
        """Names an update must still give before a discarded model is whole again (default: the
        engine cannot tell, so any update counts as complete)."""
        return []

    def _expect_every_weight(self) -> None:
        """From now on every weight is missing until an update names it (default: names not tracked)."""

    # -- helpers --------------------------------------------------------------------------------
    def _holds(self, tag: str) -> bool:
        if tag == "weights":
            return self._state in (EngineState.AWAKE, EngineState.WEIGHTS_ONLY)
        return self._state is EngineState.AWAKE

    def _require(self, state: EngineState, action: str) -> None:
        if self._state is not state:
            raise RolloutStateError(
                f"{self.name} engine cannot {action} while {self._state.value}; it must be {state.value}"
                + (" (call wake_up())" if self._state is not EngineState.RELEASED else "")
            )

    def _require_weights(self, action: str) -> None:
        if self._state not in (EngineState.AWAKE, EngineState.WEIGHTS_ONLY):
            raise RolloutStateError(
                f"{self.name} engine cannot {action} while {self._state.value}; "
                "call wake_up() (or wake_up(('weights',))) first"
            )

    def _require_generate(self) -> None:
        self._require(EngineState.AWAKE, "generate")
        if self._weights_discarded:
            raise RolloutStateError(self._discarded_weights_message())

    def _discarded_weights_message(self) -> str:
        missing = self._missing_weights()
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing) - 8} more)" if len(missing) > 8 else "")
        return (
            f"{self.name} engine cannot generate: its weights were discarded by sleep "
            f"(sleep_level={self.options.sleep_level}) and a weight sync must run first "
            "(update_weights naming every weight, or copies into engine_model() and then "
            "mark_weights_updated())" + (f"; still missing {len(missing)}: {shown}" if missing else "")
        )

    def _require_not_released(self, action: str) -> None:
        if self._state is EngineState.RELEASED:
            raise RolloutStateError(f"{self.name} engine cannot {action}: it was released")
