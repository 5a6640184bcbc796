"""Rollout with a HuggingFace transformers model: the engine for machines without vLLM.

Batched generation over left-padded prompts with a KV cache and our own sampling loop, so the
sampled tokens, their log-probs and the random stream are fully under our control.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import mmap
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from megarl.errors import ConfigError
from megarl.protocol import Batch
from megarl.rollout.base import (
    EngineOptions, RolloutEngine, SamplingParams, TokenContinuation, WeightUpdateError,
    token_budgets,
)
from megarl.rollout.output import assemble_rollout_batch, check_prompt_tensors, prompt_position_ids
from megarl.rollout.sampling import sample_next_tokens
from megarl.rollout.seeds import SEED_SPACE, row_seeds, row_uniforms

logger = logging.getLogger(__name__)

GROUPED_SDPA = "megarl_grouped_sdpa"


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' "sdpa" attention, with a decoded token's attention on CPU computed by
    `decode_attention`.

    With grouped-query attention and a padding mask, transformers repeats each key and value head
    for every query head of its group (`repeat_kv`) before the attention call, because CUDA's
    kernels would fall back to the math one with both: at each decoded token a copy of the layer's
    whole cache, group-size times over. On CPU a decoded token (one query row per head) goes to
    `decode_attention` instead, which reads the cache in place. Prompts (several query tokens),
    other devices and attention with extra terms (dropout, sinks, position bias) go to transformers'
    function, the keys and values in the query's dtype.
    """
    if (query.shape[2] != 1 or query.device.type != "cpu" or dropout != 0.0
            or any(kwargs.get(name) is not None for name in ("position_bias", "cache", "s_aux", "softcap"))
            or (attention_mask is not None and attention_mask.shape[1] != 1)):
        # A float32 cache of a reduced-precision model (`kv_storage_dtype`) meets torch's kernel in
        # the query's dtype: the cast rounds nothing, the cache holds the model's own values.
        key, value = key.to(query.dtype), value.to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _decode_attention(query, key, value, attention_mask, scale), None


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Attention of one decoded token per row over its KV cache, in float32 (float64 for a float64
    model), whatever the model's dtype: query [batch, heads, 1, dim], key and value [batch, kv_heads, keys, dim] (query head h
    reads key/value head h // (heads / kv_heads), as transformers' `repeat_kv` lays them out), mask
    [batch, 1, 1, keys] (True or 0.0: attend) or None. Returns [batch, 1, heads, dim] in the query's
    dtype, the layout transformers' attention functions return.

    The query heads of a group become the rows of one matrix product against their key/value head,
    so nothing is repeated or copied besides the float32 casts, which the engine's float32 cache
    (`kv_storage_dtype`) makes no-ops. torch's fused CPU kernel
    (`scaled_dot_product_attention`) is slower at one query row: on one thread, 32 rows over 72
    keys of 8 heads of 64 (a 25M model's decoding), 0.37 ms against 0.32 ms here in float32 and
    1.96 ms against 0.44 ms in bfloat16, where it also rounds intermediate values to bfloat16 (its
    error against float64 math exceeds the output's own rounding) and this does not
    (`benchmarks/rollout.py --engines hf,hf_fused_decode_attention`).
    """
    batch, heads, _, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    compute = torch.promote_types(query.dtype, torch.float32)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).to(compute)
    scores = torch.matmul(grouped, key.to(compute).transpose(-1, -2)).mul_(scale)
    if mask is not None:
        mask = mask.reshape(batch, 1, 1, keys)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value.to(compute)).to(query.dtype).reshape(batch, 1, heads, dim)


def _fused_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                            scale: float) -> torch.Tensor:
    """The same attention through torch's fused kernel (its grouped-query form): what
    `decode_attention` replaced, kept for `benchmarks/rollout.py` to time it against."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=True)
    return out.transpose(1, 2)


# The decoded token's attention on CPU (`grouped_sdpa_attention`); benchmarks swap it.
_decode_attention = decode_attention


# Registered once for every model of the process; the masks are the "sdpa" ones.
AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


class PreallocatedLayer(DynamicLayer):
    """A full-attention KV cache layer whose keys and values live in buffers sized for the whole
    decode (prompt columns + response tokens): a step writes its token's keys and values in place
    and attention reads a view of the filled part. transformers' `DynamicLayer` concatenates
    instead, copying the layer's whole cache at every token; at 64 tokens of a 25M model that
    copying took about a fifth of the decoding time on CPU. A write past `capacity` grows the
    buffers to twice the length needed (one copy), so a wrong estimate costs time, not results.
    `storage_dtype` (default: the keys' own) is the buffers' dtype; a wider one holds the model's
    values exactly (see `kv_storage_dtype`)."""

    def __init__(self, capacity: int, storage_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.storage_dtype = storage_dtype
        self._length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._length + key_states.shape[-2]
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
            self._allocate(key_states, value_states, max(self.capacity, end))
        elif end > self._key_buffer.shape[-2]:
            self._allocate(self._key_buffer, self._value_buffer, 2 * end)
        self._key_buffer[:, :, self._length:end].copy_(key_states)
        self._value_buffer[:, :, self._length:end].copy_(value_states)
        self._length = end
        self._point_views()
        return self.keys, self.values

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """New buffers of `length` positions (in `storage_dtype`, else the keys' dtype) holding the
        filled part of the old ones (if any)."""
        dtype = self.storage_dtype or keys.dtype
        key_buffer = keys.new_empty((*keys.shape[:2], length, keys.shape[-1]), dtype=dtype)
        value_buffer = values.new_empty((*values.shape[:2], length, values.shape[-1]), dtype=dtype)
        if self._key_buffer is not None:
            key_buffer[:, :, :self._length].copy_(self._key_buffer[:, :, :self._length])
            value_buffer[:, :, :self._length].copy_(self._value_buffer[:, :, :self._length])
        self._key_buffer, self._value_buffer = key_buffer, value_buffer

    def _point_views(self) -> None:
        self.keys = self._key_buffer[:, :, :self._length]
        self.values = self._value_buffer[:, :, :self._length]

    def get_seq_length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0
        self._key_buffer = self._value_buffer = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:  # transformers' convention: a negative count is a number of tokens
            self._length = max(0, self._length + tokens_to_remove)
        elif 0 < tokens_to_remove < self._length:  # its legacy one: a positive count is the length to keep
            self._length = tokens_to_remove
        if self.is_initialized:
            self._point_views()

    def _reindex_batch(self, select: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.is_initialized:
            self._key_buffer, self._value_buffer = select(self._key_buffer), select(self._value_buffer)
            self._point_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex_batch(lambda buffer: buffer.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex_batch(lambda buffer: buffer[indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex_batch(lambda buffer: buffer.index_select(0, beam_idx.to(buffer.device)))


# A layer's keys (and its values) above this many elements are kept in float32 on CPU by a bfloat16
# or float16 model (`kv_storage_dtype`). Measured on a 2-core AMD EPYC, bf16, alternating calls
# (`benchmarks/rollout.py --engines hf,hf_cast_cache,hf_float32_cache`): at 2.4M and 3.1M elements
# (a 25M Qwen2's 32 rows x 290 positions, 128 x 96) casting at every token was 4% faster, at 0.8M
# (32 x 96) 5%; at 6.3M (a tiny Qwen2's 512 x 96) the float32 cache was 1.10x, at 18.9M (512 x 288)
# 2.98x (`benchmarks/results/rollout_kv_cache_*_bfloat16.json`).
FLOAT32_CACHE_ELEMENTS = 4 * 2**20


def cache_layer_elements(config: Any, rows: int, capacity: int) -> int:
    """The elements of one full-attention layer's keys for `rows` sequences of `capacity` positions
    (0 where the config does not say its heads)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        return 0
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return rows * kv_heads * capacity * head_dim


def kv_storage_dtype(device: torch.device, model_dtype: torch.dtype, layer_elements: int) -> torch.dtype | None:
    """The dtype the engine's KV cache keeps keys and values in: float32 for a bfloat16 or float16
    model on CPU whose layer caches exceed `FLOAT32_CACHE_ELEMENTS`, else the model's own (None). A
    decoded token's attention on CPU computes in float32 (`decode_attention`); a cache in the
    model's dtype is cast to float32 whole, in every layer at every token. Small casts stay in the
    processor's caches and cost less than reading a float32 cache twice the size; large ones do not
    (the float32 cache was 2.98x faster at 512 rows of up to 288 positions). Widening is exact, so the
    samples do not change; a float32 cache takes twice the memory of a bfloat16 one. A model whose
    decoded tokens take transformers' kernel instead (attention sinks, logit soft-capping: none of
    the families megarl trains) would have the cache cast back at every token."""
    if (device.type == "cpu" and model_dtype in (torch.bfloat16, torch.float16)
            and layer_elements > FLOAT32_CACHE_ELEMENTS):
        return torch.float32
    return None


def decoding_cache(config: Any, capacity: int, storage_dtype: torch.dtype | None = None) -> DynamicCache:
    """transformers' cache for `config`, its full-attention layers (`DynamicLayer`) replaced by
    `PreallocatedLayer`s of `capacity` positions in `storage_dtype` (default: the model's); other
    layer kinds (sliding window, linear attention) stay transformers' own."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity, storage_dtype) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


# A CPU model's float32 and bfloat16 linear layers compute on weights reordered once into oneDNN's
# blocked layout (`PackedLinear`); False: `nn.Linear` throughout.
PACK_LINEAR_WEIGHTS = True
# The row count oneDNN lays a packed weight out for; any count runs on it. Measured on a 2-core AMD
# EPYC (one thread, a 3072 x 512 weight): 32, 64 and 256 gave the same times at 1 to 256 rows.
PACK_ROWS_HINT = 32
# When packing pays. A pack costs about one pass over the weight's bytes after every weight change,
# that is every training step; it saves a share of each forward pass. Measured on a 2-core AMD EPYC,
# one thread, every weight updated before each call (`benchmarks/rollout.py --update-between-calls
# --engines hf,hf_plain_linear`), 32 rows, plain / packed time: the quickstart's model (hidden 256)
# never gained (4 new tokens 0.81x, 8 0.90x, 16 0.97x, 32 1.00x in float32); the 25M model (hidden
# 512) gained from 8 tokens on (8: 1.06x float32, 1.02x bfloat16; 16: 1.14x, 1.13x; 64: 1.19x bfloat16).
# So a model is packed from this hidden size up, and a generation call makes new packs (after a
# weight change) only when it decodes at least this many tokens; shorter calls multiply on the
# plain weights, or on packs still current (the quickstart's 4 tokens with packing forced on then
# 0.99x: `benchmarks/results/rollout_plain_linear_*_updated_*.json`).
PACK_MIN_HIDDEN_SIZE = 512
PACK_MIN_NEW_TOKENS = 8


class PackedLinear(torch.nn.Linear):
    """`nn.Linear` whose forward pass in inference mode on CPU runs oneDNN's matrix multiply on its
    weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn`, what inductor's freezing
    does), instead of `F.linear` reading the row-major weight at every call. On a 2-core AMD EPYC
    with one thread, 32 rows against a 3072 x 512 weight took 0.97 ms against 1.40 ms in float32 and
    0.47 against 0.55 ms in bfloat16; the 25M e2e model's decode (32 rows x 64 tokens) ran 1.28x
    faster in float32 and 1.24x in bfloat16, with the same samples (`benchmarks/rollout.py --engines
    hf,hf_plain_linear`).

    The packed copy (as many bytes as the weight) is made at the first call and remade when the
    weight changed: a pack remembers its weight's storage and version counter, which every in-place
    write bumps (a copy into the weight or into a view of it, under no_grad or inference mode
    alike), and the engine drops every pack when told of writes it did not make or put to sleep
    (`HFRolloutEngine.drop_packed_weights`). Outside inference mode (autograd), on other devices or
    dtypes it is `nn.Linear`'s own forward, and so it is with `repack` False where the pack is
    missing or stale (the engine's short calls, see `PACK_MIN_NEW_TOKENS`). The parameters, their
    names and the state dict are those of the `nn.Linear` it was made from (`pack_linear_layers`
    changes the class in place)."""

    pack: tuple[tuple[int, int], torch.Tensor] | None = None  # ((storage pointer, version), packed weight)
    repack: bool = True  # make a pack where there is none or it is stale; False: F.linear then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (not torch.is_inference_mode_enabled() or x.device.type != "cpu" or x.dtype != weight.dtype
                or weight.dtype not in _PACKED_DTYPES):
            return super().forward(x)
        # A weight made in inference mode has no version counter: the engine's drops alone keep it current.
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version)
        if self.pack is None or self.pack[0] != key:
            if not self.repack:
                return super().forward(x)
            self.pack = (key, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT))
        return torch.ops.mkldnn._linear_pointwise(x, self.pack[1], self.bias, "none", [], "")

    def __getstate__(self) -> dict[str, Any]:
        # A copy or pickle of the module leaves the pack behind (oneDNN's opaque tensors have no
        # storage to copy); the copy packs its own weight at its first call.
        state = dict(super().__getstate__())
        state.pop("pack", None)
        return state


_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packs_linear_weights(device: torch.device, dtype: torch.dtype, hidden_size: int | None) -> bool:
    """Whether the engine runs its linear layers as `PackedLinear`s: on CPU with oneDNN, for a model
    of at least `PACK_MIN_HIDDEN_SIZE` (None: unknown, not packed), in float32, or in bfloat16 where
    the processor has oneDNN's bfloat16 kernels; not where oneDNN is turned off
    (`torch.backends.mkldnn.enabled`)."""
    if (not PACK_LINEAR_WEIGHTS or device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or not torch.backends.mkldnn.enabled or (hidden_size or 0) < PACK_MIN_HIDDEN_SIZE):
        return False
    return dtype in _PACKED_DTYPES and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_layers(model: torch.nn.Module) -> list[PackedLinear]:
    """Turn every plain `nn.Linear` of `model` (not its subclasses) into a `PackedLinear`, in place:
    the same module objects, parameters and names. Returns them."""
    packed = []
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PackedLinear
            packed.append(module)
    return packed


class _RowStreams:
    """The random numbers of a decode: one stream per row (`megarl.rollout.seeds`), drawn one
    uniform per row and step, computed `chunk` steps at a time for all rows at once."""

    def __init__(self, seed: int, rows: Sequence[int], device: torch.device, chunk: int = 64) -> None:
        self.seeds = row_seeds(seed, rows)
        self.device = device
        self.chunk = chunk
        self.start = 0
        self.block: torch.Tensor | None = None

    def draw(self, step: int) -> torch.Tensor:
        """(rows,) float64: each row's uniform for decoding step `step`."""
        if self.block is None or not self.start <= step < self.start + self.block.shape[1]:
            self.start = step - step % self.chunk
            self.block = torch.from_numpy(row_uniforms(self.seeds, self.start, self.chunk)).to(self.device)
        return self.block[:, step - self.start]


# Cache layers that hold only keys and values, so that repeating them along the batch repeats the
# state of each sequence (`HFRolloutEngine._decode` shares a prompt's prefill among its responses).
_REPEATABLE_CACHE_LAYERS = (DynamicLayer, PreallocatedLayer, DynamicSlidingWindowLayer)


class HFRolloutEngine(RolloutEngine):
    """Generates with a ``transformers`` causal LM held in this process.

    Weights are updated in place from HF-named full tensors (``update_weights``). The KV cache
    lives only during ``generate``. ``sleep`` at ``sleep_level`` 2 frees the storage of every weight
    (every tensor of the state dict; the Parameter objects stay, so references to them stay valid)
    on CPU and GPU alike, and ``wake_up(("weights",))`` re-allocates it, contents undefined, until
    an update has named every weight. Tensors outside the state dict, such as the rotary
    ``inv_freq`` buffers, are not rewritten by a sync and are kept. At level 1 ``sleep`` moves the
    weights to host memory on GPU; on CPU it keeps them (nothing to free).

    On CPU at level 2 each weight storage is a memory mapping of its own (`_mapped_storage`), so
    that freeing it hands its pages straight back to the OS. Weights in the C heap would stay with
    the process after a free unless the whole heap were trimmed, and a trim also hands back the
    pages the training step reuses: measured on the quickstart, its update phase then took 15-56
    ms longer, page-faulting them in again.

    On CPU a float32 or bfloat16 model of hidden size `PACK_MIN_HIDDEN_SIZE` and up has its
    `nn.Linear` layers turned into `PackedLinear`s (the same modules and parameters): generation
    multiplies on copies of their weights in oneDNN's layout, made at the first generation of at
    least `PACK_MIN_NEW_TOKENS` tokens after each weight change and dropped at sleep.
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, options: EngineOptions) -> None:
        super().__init__(options)
        if options.tensor_parallel_size != 1:
            raise ConfigError(
                f"rollout.tensor_model_parallel_size={options.tensor_parallel_size} is not supported by the "
                "hf engine (it holds the whole model in each process); use 1 or rollout.engine=vllm"
            )
        self.model = model.to(dtype=options.torch_dtype).eval()
        self.model.requires_grad_(False)
        if self.model.config._attn_implementation == "sdpa":
            self.model.set_attn_implementation(GROUPED_SDPA)
        self.device = next(self.model.parameters()).device
        # Draws the seed of each unseeded call (`SamplingParams.seed` None): the engine's own stream.
        self._generator = torch.Generator().manual_seed(options.seed)
        self._canonical, self._update_parts = _weight_names(self.model)
        self._part_owner = {part: owner for owner, parts in self._update_parts.items() for part in parts}
        self._unwritten: dict[str, set[str]] = {}  # weight -> update names still missing for it
        self._freed: list[tuple[list[torch.Tensor], int]] = []  # the tensors of each freed storage, its bytes
        self._mapped = self.device.type == "cpu" and options.sleep_level == 2
        if self._mapped:
            _move_weights_to_mappings(self.model)
        text_config = self.model.config.get_text_config()
        packs = packs_linear_weights(self.device, self.model.dtype, getattr(text_config, "hidden_size", None))
        self._packed_linears = pack_linear_layers(self.model) if packs else []

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_path: str | Path, options: EngineOptions, device: str | None = None) -> HFRolloutEngine:
        """Load a HF model directory (config.json + safetensors)."""
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=options.torch_dtype)
        return cls(model.to(device or _default_device()), options)

    @classmethod
    def from_config(
        cls,
        config: Any,
        options: EngineOptions,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        device: str | None = None,
    ) -> HFRolloutEngine:
        """Build the model from a HF config; fill it from ``state_dict`` (HF names) when given."""
        model = AutoModelForCausalLM.from_config(config, dtype=options.torch_dtype)
        engine = cls(model.to(device or _default_device()), options)
        if state_dict is not None:
            engine.update_weights(state_dict.items())
        return engine

    @property
    def sleep_frees_memory(self) -> bool:
        return self.options.sleep_level == 2 or self.device.type != "cpu"

    @property
    def sleep_discards_weights(self) -> bool:
        return self.options.sleep_level == 2

    # -- generation -----------------------------------------------------------------------------
    def _generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return self._decode(prompts, params)

    def generate_interruptible(
        self, contexts: Sequence[Sequence[int]], params: SamplingParams, max_new_tokens: Sequence[int],
        every: int, interrupted: Callable[[int], bool],
    ) -> list[TokenContinuation]:
        """`RolloutEngine.generate_interruptible` in one decoding loop: its KV cache stays between two
        checks, and a stop ends the loop (one random stream per context, from `params.seed`, for
        the whole call)."""
        self._require_generate()
        budgets = token_budgets(contexts, params, max_new_tokens)
        if not contexts:
            return []
        one = dataclasses.replace(params, n=1, max_new_tokens=max(budgets))
        out = self._decode(self._context_batch(contexts), one, budgets, (every, interrupted))
        return self._continuations(out, params, budgets)

    @torch.inference_mode()
    def _decode(self, prompts: Batch, params: SamplingParams, budgets: Sequence[int] | None = None,
                interrupt: tuple[int, Callable[[int], bool]] | None = None) -> Batch:
        """Sample `params.n` responses per prompt row with a KV cache. `budgets` (one per row, n=1):
        a row that reached its budget counts as finished. `interrupt` = (every, interrupted): after
        every `every` tokens, `interrupted(checks_done)` true stops the loop, unfinished rows as they are."""
        input_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
        check_prompt_tensors(input_ids, prompt_mask)
        n, r = params.n, params.max_new_tokens
        for module in self._packed_linears:  # a short call would not win back the packing
            module.repack = r >= PACK_MIN_NEW_TOKENS
        # Prompts come left-padded to the data's max_prompt_length: the columns that are padding in
        # every row are dropped (the attention never reads them; positions come from the mask), so
        # the prefill and every decoding step's attention run over the batch's longest prompt only.
        first = int(prompt_mask.long().argmax(dim=1).min())  # left padding: each row's first token
        ids = input_ids[:, first:].long().to(self.device)
        mask = prompt_mask[:, first:].long().to(self.device)
        rows = input_ids.shape[0] * n
        capacity = ids.shape[1] + r
        storage = kv_storage_dtype(self.device, self.model.dtype,
                                   cache_layer_elements(self.model.config, rows, capacity))
        cache = decoding_cache(self.model.config, capacity, storage)
        # The n responses of a prompt share its prefill: each prompt runs once and its KV cache and
        # last logits are repeated n times after (vLLM's prefix sharing for n > 1). Caches whose
        # layers hold more than keys and values (linear attention) get the prompts repeated first.
        share_prefill = n > 1 and all(type(layer) in _REPEATABLE_CACHE_LAYERS for layer in cache.layers)
        if not share_prefill:
            ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        positions = prompt_position_ids(mask)

        stop_ids = torch.tensor(sorted(set(self.options.eos_token_ids) | set(params.stop_token_ids)), device=self.device)
        streams = None if params.greedy else _RowStreams(
            self._call_seed(params), [p * n + c for p in params.batch_indices(input_ids.shape[0]) for c in range(n)],
            self.device)

        responses = torch.full((rows, r), self.options.pad_token_id, dtype=torch.long, device=self.device)
        log_probs = torch.zeros((rows, r), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        row_budgets = None if budgets is None else torch.as_tensor(list(budgets), device=self.device)

        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        ).logits[:, -1]
        if share_prefill:
            cache.batch_repeat_interleave(n)
            logits, mask, positions = (t.repeat_interleave(n, dim=0) for t in (logits, mask, positions))
        for step in range(r):
            tokens, step_log_probs = sample_next_tokens(logits, params, self.options.logprobs_mode,
                                                        uniforms=None if streams is None else streams.draw(step))
            tokens = tokens.masked_fill(finished, self.options.pad_token_id)
            responses[:, step] = tokens
            log_probs[:, step] = step_log_probs.masked_fill(finished, 0.0)
            lengths += (~finished).long()
            if not params.ignore_eos:
                finished |= torch.isin(tokens, stop_ids)
            if row_budgets is not None:
                finished |= lengths >= row_budgets
            if step == r - 1 or bool(finished.all()):
                break
            if interrupt is not None and (step + 1) % interrupt[0] == 0 and interrupt[1]((step + 1) // interrupt[0]):
                break
            # Finished rows keep decoding pad tokens; their outputs are masked out above.
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions[:, -1:] + 1
            logits = self.model(
                input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True,
            ).logits[:, -1]
        del cache
        return assemble_rollout_batch(
            prompts, responses.cpu(), lengths.cpu(), log_probs.cpu(), n, self.options.pad_token_id
        )

    def _call_seed(self, params: SamplingParams) -> int:
        """The call's seed: `params.seed`, or the next draw of the engine's own stream."""
        if params.seed is not None:
            return int(params.seed)
        return int(torch.randint(0, SEED_SPACE, (1,), generator=self._generator))

    # -- weights --------------------------------------------------------------------------------
    def engine_model(self) -> torch.nn.Module:
        """The transformers model; parameter names are the HF names."""
        return self.model

    @torch.no_grad()
    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        # state_dict() also lists tied weights (lm_head.weight when tied to the embedding); its
        # tensors share storage with the parameters, so copying into them updates the model.
        targets = self.model.state_dict()
        loaded = 0
        for name, tensor in named_tensors:
            target = self._target(targets, name, tuple(tensor.shape))
            if tensor.is_floating_point() != target.is_floating_point():
                raise WeightUpdateError(f"hf engine: parameter {name!r} is {target.dtype}, the update gives {tensor.dtype}")
            target.copy_(tensor)
            self._note_written(name)
            loaded += 1
        self.drop_packed_weights()  # stale now (the copies bumped the version counters): free them
        return loaded

    def weight_targets(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The model's own tensors (views of its state dict; one expert of a fused expert
        parameter is a view of it): a weight sync writes into them, with no copy of the model."""
        self._require_weights("update weights")
        targets = self.model.state_dict()
        return {name: self._target(targets, name, tuple(shape)) for name, shape in shapes.items()}

    def weights_written(self, names: Iterable[str]) -> None:
        super().weights_written(names)
        self.drop_packed_weights()

    def _target(self, targets: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The state-dict tensor (or fused-expert view) an update of `name` with `shape` writes."""
        target = targets.get(name)
        if target is None:
            target = _fused_expert_slice(targets, name)
        if target is None:
            close = difflib.get_close_matches(name, list(targets), n=3)
            raise WeightUpdateError(
                f"hf engine: unknown parameter {name!r}" + (f"; did you mean {close}?" if close else "")
                + f" (the model has {len(targets)} HF-named tensors)"
            )
        if tuple(target.shape) != shape:
            raise WeightUpdateError(f"hf engine: parameter {name!r} has shape {tuple(target.shape)}, "
                                    f"the update gives {shape}")
        return target

    def drop_packed_weights(self) -> None:
        """Forget the packed copies of the linear weights (`PackedLinear`): the next forward pass
        packs each weight again. Done after every update (its stale packs freed at once), after
        writes the engine is told of but did not make (`weights_written`, `mark_weights_updated`:
        they may bypass the version counters, as a write into the storage does) and at sleep."""
        for module in self._packed_linears:
            module.pack = None

    def _note_written(self, name: str) -> None:
        owner = self._canonical.get(name)
        if owner is not None:  # the whole tensor (a tied name covers its twin)
            self._unwritten.pop(owner, None)
            return
        owner = self._part_owner.get(name)  # one expert of a fused tensor
        if owner in self._unwritten:
            self._unwritten[owner].discard(name)
            if not self._unwritten[owner]:
                del self._unwritten[owner]

    def _missing_weights(self) -> list[str]:
        return sorted(part for parts in self._unwritten.values() for part in parts)

    def _expect_every_weight(self) -> None:
        self._unwritten = {owner: set(parts) for owner, parts in self._update_parts.items()}

    def _weights_rewritten(self) -> None:
        self.drop_packed_weights()
        self._unwritten.clear()

    # -- memory ---------------------------------------------------------------------------------
    def _sleep(self) -> None:
        self.drop_packed_weights()
        if self.options.sleep_level == 2:
            self._freed = _free_weight_storages(self.model)  # a mapped storage is unmapped here
        elif self.device.type != "cpu":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _wake_up(self, tags: tuple[str, ...]) -> None:
        if "weights" not in tags:
            return
        if self._freed:
            with torch.no_grad():
                for group, nbytes in self._freed:
                    if self._mapped:
                        _set_storage(group, _mapped_storage(nbytes))
                    else:
                        group[0].untyped_storage().resize_(nbytes)
            self._freed = []
            self._expect_every_weight()
        elif self.options.sleep_level == 1 and self.device.type != "cpu":
            self.model.to(self.device)

    def _release(self) -> None:
        self._packed_linears = []
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


_EXPERT_NAME = re.compile(r"^(?P<stem>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _fused_expert_slice(targets: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of transformers' fused expert parameters that a per-expert checkpoint name stands
    for: `experts.gate_up_proj[e]` holds [gate; up] rows, `experts.down_proj[e]` the down weight."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    stem, expert, proj = match["stem"], int(match["expert"]), match["proj"]
    fused = targets.get(f"{stem}.down_proj" if proj == "down_proj" else f"{stem}.gate_up_proj")
    if fused is None or fused.dim() != 3 or expert >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused[expert]
    gate, up = fused[expert].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up


def _weight_names(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, frozenset[str]]]:
    """How update names map onto the model's weights (its state-dict tensors).

    Returns ``canonical`` (every state-dict name -> the first name of the same tensor, so tied
    ``lm_head.weight`` -> ``model.embed_tokens.weight``) and ``parts`` (canonical name -> the
    update names that together rewrite all of it: the name itself, or for transformers' fused
    expert tensors the per-expert checkpoint names that ``_fused_expert_slice`` accepts).
    """
    canonical: dict[str, str] = {}
    first: dict[int, str] = {}
    parts: dict[str, frozenset[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        canonical[name] = first.setdefault(id(tensor), name)
        if canonical[name] != name:
            continue
        fused = _FUSED_EXPERTS.match(name)
        if fused is not None and tensor.dim() == 3:
            projs = ("down_proj",) if fused["proj"] == "down_proj" else ("gate_proj", "up_proj")
            parts[name] = frozenset(
                f"{fused['stem']}.{e}.{proj}.weight" for e in range(tensor.shape[0]) for proj in projs
            )
        else:
            parts[name] = frozenset((name,))
    return canonical, parts


_FUSED_EXPERTS = re.compile(r"^(?P<stem>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _weight_storage_groups(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The state-dict tensors grouped by the storage they share (tied weights appear once).

    Storages shared with a tensor outside the state dict (which no weight sync rewrites) are left
    out, as are empty ones.
    """
    weights = model.state_dict(keep_vars=True)
    kept = {
        t.untyped_storage().data_ptr()
        for named in (model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
        for name, t in named
        if name not in weights
    }
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in weights.values():
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.untyped_storage().nbytes() and ptr not in kept:
            group = groups.setdefault(ptr, [])
            if not any(t is tensor for t in group):  # tied weights appear under two names
                group.append(tensor)
    return list(groups.values())


def _set_storage(group: list[torch.Tensor], storage: torch.UntypedStorage) -> None:
    """Put every tensor of `group` on `storage`, at the offsets, shapes and strides it has."""
    for tensor in group:
        tensor.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


def _mapped_storage(nbytes: int) -> torch.UntypedStorage:
    """`nbytes` of anonymous private memory mapping as a storage: its pages come on first write and
    go back to the OS when the last tensor on it lets go (the storage holds the mapping)."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)  # Linux: all pages at once, not a fault each
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8).untyped_storage()


def _move_weights_to_mappings(model: torch.nn.Module) -> None:
    """Copy each weight storage of a CPU model into a mapping of its own (see `_mapped_storage`)."""
    with torch.no_grad():
        for group in _weight_storage_groups(model):
            old = group[0].untyped_storage()
            new = _mapped_storage(old.nbytes())
            new.copy_(old)
            _set_storage(group, new)


def _free_weight_storages(model: torch.nn.Module) -> list[tuple[list[torch.Tensor], int]]:
    """Shrink the storage of every state-dict tensor to 0 bytes, keeping the tensor objects;
    returns the tensors of each freed storage with its size, to re-allocate on wake-up.

    A storage that cannot be resized (a memory mapping: `_mapped_storage`, or a safetensors load)
    is swapped for an empty one under the same tensors, which unmaps it: the contents are
    discarded anyway.
    """
    freed = []
    with torch.no_grad():
        for group in _weight_storage_groups(model):
            storage = group[0].untyped_storage()
            nbytes = storage.nbytes()
            if not storage.resizable():
                storage = torch.UntypedStorage(nbytes, device=storage.device)  # not touched: no memory yet
                _set_storage(group, storage)
            storage.resize_(0)
            freed.append((group, nbytes))
    return freed


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
