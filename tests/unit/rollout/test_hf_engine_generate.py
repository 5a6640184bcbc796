"""HF rollout engine: the batch contract, greedy decoding, log-probs, stops, seeding, filters.

References are independent: an uncached argmax loop and uncached full forwards of the tiny model,
one unpadded sequence at a time, in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache
from rollout_helpers import PAD, PROMPTS, argmax_decode, kept_response, prompt_batch, reference_log_softmax, tiny_model

from megarl.errors import DataError
from megarl.protocol import Batch
from megarl.rollout import EngineOptions, SamplingParams, hf_engine
from megarl.rollout.hf_engine import HFRolloutEngine

pytestmark = pytest.mark.unit

R = 6


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model()


@pytest.fixture(scope="module")
def model64(model: torch.nn.Module) -> torch.nn.Module:
    """The same model in float64, for tokens compared across batch shapes or against an uncached loop:
    in float32 the two sides' matrix multiplies can round differently on another CPU, and a near-tie
    would flip a token."""
    return copy.deepcopy(model).double()


def make_engine(model: torch.nn.Module, eos: tuple[int, ...] = (), **kwargs) -> HFRolloutEngine:
    return HFRolloutEngine(model, EngineOptions(pad_token_id=PAD, eos_token_ids=eos, **kwargs))


def test_batch_columns_shapes_and_interleaving(model: torch.nn.Module) -> None:
    n = 2
    prompts = prompt_batch(PROMPTS, uids=["a", "b", "c"])
    prompts["data_source"] = ["x", "y", "z"]
    prompts.meta["global_step"] = 3
    out = make_engine(model).generate(prompts, SamplingParams(n=n, max_new_tokens=R, seed=1))
    p = prompts["input_ids"].shape[1]
    rows = len(PROMPTS) * n
    assert len(out) == rows
    expected_shapes = {
        "prompts": (rows, p), "responses": (rows, R), "response_mask": (rows, R),
        "input_ids": (rows, p + R), "attention_mask": (rows, p + R), "position_ids": (rows, p + R),
        "rollout_log_probs": (rows, R),
    }
    for key, shape in expected_shapes.items():
        assert tuple(out[key].shape) == shape, key
    assert out["rollout_log_probs"].dtype == torch.float32
    assert out["responses"].dtype == torch.int64 and out["input_ids"].dtype == torch.int64
    assert list(out["uid"]) == ["a", "a", "b", "b", "c", "c"]
    assert list(out["data_source"]) == ["x", "x", "y", "y", "z", "z"]
    assert out.meta["global_step"] == 3
    for row in range(rows):
        prompt = row // n
        assert torch.equal(out["prompts"][row], prompts["input_ids"][prompt])
        assert torch.equal(out["input_ids"][row], torch.cat([prompts["input_ids"][prompt], out["responses"][row]]))
        assert torch.equal(
            out["attention_mask"][row], torch.cat([prompts["attention_mask"][prompt], out["response_mask"][row]])
        )
        # positions written out by hand: 0 on padding, 0.. on the prompt, then one per response slot
        pad = p - len(PROMPTS[prompt])
        expected_positions = [0] * pad + list(range(len(PROMPTS[prompt]))) + [
            len(PROMPTS[prompt]) + k for k in range(R)
        ]
        assert out["position_ids"][row].tolist() == expected_positions
        # no EOS configured: every response uses all R slots
        assert out["response_mask"][row].tolist() == [1] * R


def test_greedy_equals_an_uncached_argmax_loop(model64: torch.nn.Module) -> None:
    model = model64
    out = make_engine(model).generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    for i, prompt in enumerate(PROMPTS):
        expected = argmax_decode(model, prompt, R)
        assert out["responses"][i].tolist() == expected
        reference = reference_log_softmax(model, prompt, expected)
        expected_lp = reference[torch.arange(R), torch.tensor(expected)]
        torch.testing.assert_close(out["rollout_log_probs"][i].double(), expected_lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature, mode", [(1.0, "processed"), (0.7, "processed"), (0.7, "raw")])
def test_sampled_log_probs_match_a_full_forward(model: torch.nn.Module, temperature: float, mode: str) -> None:
    n = 2
    engine = make_engine(model, logprobs_mode=mode)
    out = engine.generate(prompt_batch(PROMPTS), SamplingParams(n=n, temperature=temperature, max_new_tokens=R, seed=3))
    for row in range(len(out)):
        prompt = PROMPTS[row // n]
        response = kept_response(out, row)
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()[len(prompt) - 1 : len(prompt) - 1 + len(response)]
        scale = temperature if mode == "processed" else 1.0
        expected = torch.log_softmax(logits / scale, dim=-1)[torch.arange(len(response)), torch.tensor(response)]
        torch.testing.assert_close(out["rollout_log_probs"][row].double(), expected, atol=1e-5, rtol=0)


def test_eos_ends_the_response_and_is_kept(model: torch.nn.Module) -> None:
    free = make_engine(model).generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    row0 = free["responses"][0].tolist()
    # EOS := the greedy token at the first step where it appears for the first time (at least step 1)
    step = next(k for k in range(1, R) if row0[k] not in row0[:k])
    eos = row0[step]
    out = make_engine(model, eos=(eos,)).generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    assert out["responses"][0].tolist() == row0[: step + 1] + [PAD] * (R - step - 1)
    assert out["response_mask"][0].tolist() == [1] * (step + 1) + [0] * (R - step - 1)
    assert out["rollout_log_probs"][0, step + 1 :].abs().sum() == 0
    assert out["attention_mask"][0, -R:].tolist() == out["response_mask"][0].tolist()
    # rows that never produce EOS are untouched
    for i in range(1, len(PROMPTS)):
        if eos not in free["responses"][i].tolist():
            assert torch.equal(out["responses"][i], free["responses"][i])
            assert out["response_mask"][i].tolist() == [1] * R


def test_stop_token_ids_end_the_response(model: torch.nn.Module) -> None:
    free = make_engine(model).generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    row2 = free["responses"][2].tolist()
    step = next(k for k in range(R) if row2[k] not in row2[:k])
    out = make_engine(model).generate(
        prompt_batch(PROMPTS), SamplingParams.make_greedy(R, stop_token_ids=[row2[step]])
    )
    assert out["response_mask"][2].tolist() == [1] * (step + 1) + [0] * (R - step - 1)
    assert kept_response(out, 2) == row2[: step + 1]
    ignored = make_engine(model).generate(
        prompt_batch(PROMPTS), SamplingParams.make_greedy(R, stop_token_ids=[row2[step]], ignore_eos=True)
    )
    assert ignored["responses"][2].tolist() == row2


def test_a_seed_reproduces_and_the_engine_stream_moves_on(model: torch.nn.Module) -> None:
    prompts = prompt_batch(PROMPTS)
    engine = make_engine(model)
    first = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=R, seed=11))
    again = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=R, seed=11))
    other = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=R, seed=12))
    assert torch.equal(first["responses"], again["responses"])
    assert torch.equal(first["rollout_log_probs"], again["rollout_log_probs"])
    assert not torch.equal(first["responses"], other["responses"])
    unseeded_a = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=R))
    unseeded_b = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=R))
    assert not torch.equal(unseeded_a["responses"], unseeded_b["responses"])
    # two engines built with the same seed produce the same unseeded stream
    fresh = make_engine(model).generate(prompts, SamplingParams(n=2, max_new_tokens=R))
    assert torch.equal(fresh["responses"], make_engine(model).generate(prompts, SamplingParams(n=2, max_new_tokens=R))["responses"])
    # the n samples of a prompt differ from one another
    assert not torch.equal(first["responses"][0], first["responses"][1])


def test_greedy_n_samples_repeat_the_single_greedy_answer(model64: torch.nn.Module) -> None:
    engine = make_engine(model64)
    single = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    tripled = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R, n=3))
    for i in range(len(PROMPTS)):
        for j in range(3):
            assert torch.equal(tripled["responses"][i * 3 + j], single["responses"][i])


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5, temperature=3.0)])
def test_filters_that_keep_one_token_equal_greedy(model64: torch.nn.Module, filters: dict) -> None:
    engine = make_engine(model64)
    greedy = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    narrow = engine.generate(prompt_batch(PROMPTS), SamplingParams(n=2, max_new_tokens=R, seed=5, **filters))
    assert torch.equal(narrow["responses"], greedy["responses"].repeat_interleave(2, dim=0))
    # a single kept token has probability 1 under the processed distribution
    assert narrow["rollout_log_probs"].abs().max() < 1e-6


def test_top_k_and_top_p_restrict_the_support(model: torch.nn.Module) -> None:
    n, k, top_p = 4, 3, 0.3
    engine = make_engine(model)
    out_k = engine.generate(prompt_batch(PROMPTS), SamplingParams(n=n, max_new_tokens=R, top_k=k, seed=7))
    out_p = engine.generate(prompt_batch(PROMPTS), SamplingParams(n=n, max_new_tokens=R, top_p=top_p, seed=7))
    for row in range(len(out_k)):
        prompt = PROMPTS[row // n]
        response = kept_response(out_k, row)
        reference = reference_log_softmax(model, prompt, response)
        for t, token in enumerate(response):
            top = torch.topk(reference[t], k)
            assert token in top.indices.tolist()
            renormalised = reference[t, token] - torch.logsumexp(top.values, dim=0)
            assert out_k["rollout_log_probs"][row, t].item() == pytest.approx(renormalised.item(), abs=1e-5)
        response = kept_response(out_p, row)
        reference = reference_log_softmax(model, prompt, response)
        for t, token in enumerate(response):
            # nucleus by a plain loop: most likely tokens until their mass reaches top_p
            probs = reference[t].exp().tolist()
            nucleus, mass = [], 0.0
            for candidate in sorted(range(len(probs)), key=lambda v: -probs[v]):
                if mass >= top_p:
                    break
                nucleus.append(candidate)
                mass += probs[candidate]
            assert token in nucleus
            expected = reference[t, token] - torch.logsumexp(reference[t, nucleus], dim=0)
            assert out_p["rollout_log_probs"][row, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_prompt_position_ids_given_by_the_batch_are_kept(model: torch.nn.Module) -> None:
    prompts = prompt_batch(PROMPTS[:1])
    prompts["position_ids"] = torch.arange(10, 10 + len(PROMPTS[0])).unsqueeze(0)
    out = make_engine(model).generate(prompts, SamplingParams.make_greedy(3))
    assert out["position_ids"][0].tolist() == [10, 11, 12, 13, 14, 15, 16]


def test_right_padded_or_empty_prompts_are_refused(model: torch.nn.Module) -> None:
    engine = make_engine(model)
    right = Batch.from_dict({"input_ids": torch.tensor([[5, 6, 0]]), "attention_mask": torch.tensor([[1, 1, 0]])})
    with pytest.raises(DataError, match=r"rows \[0\] are not left-padded"):
        engine.generate(right, SamplingParams.make_greedy(2))
    empty = Batch.from_dict({"input_ids": torch.tensor([[5, 6], [0, 0]]), "attention_mask": torch.tensor([[1, 1], [0, 0]])})
    with pytest.raises(DataError, match=r"rows \[1\] have no prompt tokens"):
        engine.generate(empty, SamplingParams.make_greedy(2))


def test_columns_of_padding_only_are_not_computed_and_change_nothing(model: torch.nn.Module) -> None:
    """Prompts padded wider than the longest one (the data pads to max_prompt_length) generate the
    same samples as the tight batch; the model only ever sees the longest prompt's width."""
    tight = prompt_batch(PROMPTS)
    extra = 3
    wide = Batch.from_dict({
        "input_ids": torch.nn.functional.pad(tight["input_ids"], (extra, 0), value=PAD),
        "attention_mask": torch.nn.functional.pad(tight["attention_mask"], (extra, 0), value=0),
    }, non_tensors={"uid": list(tight["uid"])})
    widths: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        params = SamplingParams(n=2, max_new_tokens=R, seed=5)
        out_wide = make_engine(model).generate(wide, params)
    finally:
        hook.remove()
    out_tight = make_engine(model).generate(tight, params)
    assert widths[0] == max(len(p) for p in PROMPTS) and set(widths[1:]) == {1}
    assert torch.equal(out_wide["responses"], out_tight["responses"])
    assert torch.equal(out_wide["rollout_log_probs"], out_tight["rollout_log_probs"])
    assert out_wide["prompts"].shape[1] == tight["input_ids"].shape[1] + extra  # the batch keeps its width
    assert torch.equal(out_wide["prompts"][:, extra:], out_tight["prompts"])


def test_the_responses_of_a_prompt_share_its_prefill(model64: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """n responses a prompt: the prefill runs over each prompt once and its KV cache and last logits
    serve all n; the samples and log-probs are those of a prefill over every prompt repeated n times
    (the path for caches that cannot be repeated). In float64, so that the two batch shapes' matrix
    multiplies round alike to far below what a sample could turn on."""
    wide = model64
    n, params = 4, SamplingParams(n=4, max_new_tokens=R, seed=7)
    batch_rows: list[int] = []
    hook = wide.register_forward_pre_hook(lambda module, args, kwargs: batch_rows.append(kwargs["input_ids"].shape[0]),
                                          with_kwargs=True)
    try:
        shared = make_engine(wide).generate(prompt_batch(PROMPTS), params)
        shared_rows, batch_rows[:] = list(batch_rows), []
        monkeypatch.setattr(hf_engine, "_REPEATABLE_CACHE_LAYERS", ())
        repeated = make_engine(wide).generate(prompt_batch(PROMPTS), params)
    finally:
        hook.remove()
    assert shared_rows[0] == len(PROMPTS) and set(shared_rows[1:]) == {n * len(PROMPTS)}
    assert set(batch_rows) == {n * len(PROMPTS)}
    assert torch.equal(shared["responses"], repeated["responses"])
    torch.testing.assert_close(shared["rollout_log_probs"], repeated["rollout_log_probs"], atol=1e-6, rtol=0)
    # and the n samples of a prompt are not copies of one another
    assert len({tuple(shared["responses"][row].tolist()) for row in range(n)}) > 1


@pytest.mark.parametrize("capacity", [4 + R, 3])  # sized for the decode; too small, so that it grows
def test_the_preallocated_cache_holds_what_transformers_cache_holds(model64: torch.nn.Module, capacity: int) -> None:
    """`decoding_cache` against transformers' own `DynamicCache` on the same float64 decode: the same
    keys, values and logits at every step, the prefill repeated along the batch as the engine does
    for n > 1, and, once sized, a step writes into the same buffers (no copy of the cache a token)."""
    wide = model64
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    ours, theirs = hf_engine.decoding_cache(wide.config, capacity), DynamicCache(config=wide.config)
    assert all(isinstance(layer, hf_engine.PreallocatedLayer) for layer in ours.layers)
    with torch.inference_mode():
        logits = [wide(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1] for cache in (ours, theirs)]
        for cache in (ours, theirs):
            cache.batch_repeat_interleave(2)
        logits = [rows.repeat_interleave(2, dim=0) for rows in logits]
        buffers = None
        for step in range(R - 1):
            torch.testing.assert_close(logits[0], logits[1], atol=1e-12, rtol=0)
            tokens = logits[1].argmax(-1, keepdim=True)
            logits = [wide(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1] for cache in (ours, theirs)]
            for mine, reference in zip(ours.layers, theirs.layers):
                assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)
            assert ours.get_seq_length() == theirs.get_seq_length() == ids.shape[1] + step + 1
            pointers = [layer.keys.data_ptr() for layer in ours.layers]
            if capacity >= ours.get_seq_length():
                assert buffers in (None, pointers)
                buffers = pointers
    ours.crop(-2)
    theirs.crop(-2)
    for mine, reference in zip(ours.layers, theirs.layers):
        assert torch.equal(mine.keys, reference.keys) and torch.equal(mine.values, reference.values)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_attention_of_a_decoded_token_equals_dense_math(groups: int) -> None:
    """`grouped_sdpa_attention` for one query token over a left-padded float64 cache, against the
    attention written out per head (query head h reads key/value head h // groups), and against
    transformers' own sdpa function, which repeats the key/value heads first."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    generator = torch.Generator().manual_seed(groups)
    batch, kv_heads, keys, head_dim = 3, 2, 7, 8
    heads = kv_heads * groups
    query = torch.randn(batch, heads, 1, head_dim, dtype=torch.float64, generator=generator)
    key, value = (torch.randn(batch, kv_heads, keys, head_dim, dtype=torch.float64, generator=generator)
                  for _ in range(2))
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    mask[1, ..., :3] = False  # left padding of rows 1 and 2
    mask[2, ..., :1] = False
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    out, _ = hf_engine.grouped_sdpa_attention(module, query, key, value, mask, scaling=0.3)
    assert out.shape == (batch, 1, heads, head_dim)
    for b in range(batch):
        for h in range(heads):
            k, v = key[b, h // groups], value[b, h // groups]
            scores = (k @ query[b, h, 0]) * 0.3
            weights = torch.softmax(scores.masked_fill(~mask[b, 0, 0], float("-inf")), dim=0)
            torch.testing.assert_close(out[b, 0, h], weights @ v, atol=1e-12, rtol=0)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(out, theirs, atol=1e-12, rtol=0)


def test_decoded_token_attention_of_a_bf16_model_is_computed_in_float32() -> None:
    """`decode_attention` on bfloat16 inputs: against float64 math over the same (bfloat16) values
    the only error left is the final rounding to bfloat16 (at most its unit roundoff, 2**-8 of the
    value: 8 significand bits) plus float32 rounding (about 1e-5 at these magnitudes; 1e-4 allowed).
    torch's fused CPU kernel, which rounds intermediate values to bfloat16, exceeds it here by 0.007.
    An additive float mask (0 / -inf) gives what the boolean one gives."""
    generator = torch.Generator().manual_seed(5)
    batch, kv_heads, groups, keys, head_dim = 4, 2, 4, 40, 64
    heads = kv_heads * groups
    query = torch.randn(batch, heads, 1, head_dim, generator=generator).mul(3).bfloat16()
    key, value = (torch.randn(batch, kv_heads, keys, head_dim, generator=generator).mul(3).bfloat16() for _ in range(2))
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    mask[0, ..., :11] = False
    mask[3, ..., :2] = False
    out = hf_engine.decode_attention(query, key, value, mask, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == (batch, 1, heads, head_dim)
    q, k, v = (t.double() for t in (query, key, value))
    scores = torch.einsum("bhd,bhkd->bhk", q[:, :, 0], k.repeat_interleave(groups, dim=1)) * 0.125
    weights = torch.softmax(scores.masked_fill(~mask[:, 0], float("-inf")), dim=-1)
    reference = torch.einsum("bhk,bhkd->bhd", weights, v.repeat_interleave(groups, dim=1))
    error = (out[:, 0].double() - reference).abs()
    assert bool((error <= reference.abs() * 2.0 ** -8 + 1e-4).all()), float((error - reference.abs() * 2.0 ** -8).max())
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert torch.equal(hf_engine.decode_attention(query, key, value, additive, 0.125), out)


def test_the_engine_decodes_with_grouped_attention() -> None:
    """An sdpa model's decoding runs through `grouped_sdpa_attention` (4 query heads over 2
    key/value heads), and its greedy tokens and log-probs are those of a copy of the model left on
    transformers' sdpa, decoded without a cache."""
    model = tiny_model(seed=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    theirs = copy.deepcopy(model)
    engine = make_engine(copy.deepcopy(model))
    assert theirs.config._attn_implementation == "sdpa"
    assert engine.model.config._attn_implementation == hf_engine.GROUPED_SDPA
    out = engine.generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))
    for i, prompt in enumerate(PROMPTS):
        expected = argmax_decode(theirs, prompt, R)
        assert out["responses"][i].tolist() == expected
        reference = reference_log_softmax(theirs, prompt, expected)
        torch.testing.assert_close(out["rollout_log_probs"][i].double(), reference[torch.arange(R), torch.tensor(expected)],
                                   atol=1e-5, rtol=0)


def test_a_bf16_engine_on_cpu_keeps_a_large_kv_cache_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 model's KV cache on CPU is float32 once a layer's keys exceed
    `FLOAT32_CACHE_ELEMENTS` (`kv_storage_dtype`), and growing it past its capacity keeps that
    dtype. Widening is exact, so the samples and log-probs are bit for bit those of a cache kept in
    bfloat16 and cast at every token; the prefill, which runs transformers' kernel, gets the keys
    and values in the query's dtype (a float32 cache under a bfloat16 query would fail there).
    float32 and float64 models, small caches and other devices keep the model's dtype."""
    big = hf_engine.FLOAT32_CACHE_ELEMENTS + 1
    assert hf_engine.kv_storage_dtype(torch.device("cpu"), torch.bfloat16, big) == torch.float32
    assert hf_engine.kv_storage_dtype(torch.device("cpu"), torch.float16, big) == torch.float32
    assert hf_engine.kv_storage_dtype(torch.device("cpu"), torch.bfloat16, big - 1) is None
    assert hf_engine.kv_storage_dtype(torch.device("cpu"), torch.float32, big) is None
    assert hf_engine.kv_storage_dtype(torch.device("cpu"), torch.float64, big) is None
    assert hf_engine.kv_storage_dtype(torch.device("cuda"), torch.bfloat16, big) is None

    model = tiny_model(seed=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    # rows x key/value heads x positions x head dim, the positions being the prompt's and the response's
    assert hf_engine.cache_layer_elements(model.config, 6, 10) == 6 * 2 * 10 * 16
    engine = make_engine(copy.deepcopy(model), dtype="bfloat16")
    seen: list[torch.dtype] = []
    build = hf_engine.decoding_cache

    def recording_cache(config, capacity, storage_dtype=None):
        seen.append(storage_dtype)
        return build(config, capacity, storage_dtype)
    monkeypatch.setattr(hf_engine, "decoding_cache", recording_cache)
    params = SamplingParams(n=3, max_new_tokens=2 * R, seed=11)
    small = engine.generate(prompt_batch(PROMPTS), params)
    monkeypatch.setattr(hf_engine, "FLOAT32_CACHE_ELEMENTS", 0)
    wide = engine.generate(prompt_batch(PROMPTS), params)
    assert seen == [None, torch.float32]
    assert torch.equal(wide["responses"], small["responses"])
    assert torch.equal(wide["rollout_log_probs"], small["rollout_log_probs"])

    layer = hf_engine.PreallocatedLayer(2, torch.float32)
    keys = torch.randn(1, 2, 3, 4).bfloat16()
    layer.update(keys, keys + 1)
    layer.update(keys[:, :, :1], keys[:, :, :1] - 1)  # past the capacity: the buffers grow
    assert layer.keys.dtype == layer.values.dtype == torch.float32
    assert torch.equal(layer.keys, torch.cat([keys, keys[:, :, :1]], dim=2).float())
    assert torch.equal(layer.values, torch.cat([keys + 1, keys[:, :, :1] - 1], dim=2).float())
