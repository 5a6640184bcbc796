"""Random streams of seeded rollouts: one per response row of the whole batch, so data-parallel
ranks, samples of a prompt, DAPO attempts and steps never share one, a seeded run reproduces, and
a batch samples the same whatever its split over ranks (`megarl.rollout.seeds`)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rollout_helpers import PAD, prompt_batch, tiny_model

from megarl.protocol import Batch
from megarl.errors import ConfigError
from megarl.rollout.base import EngineOptions, RolloutEngine, SamplingParams
from megarl.rollout.hf_engine import HFRolloutEngine
from megarl.rollout.sampling import inverse_cdf_sample, sample_next_tokens
from megarl.rollout.seeds import SEED_SPACE, call_base, mix64, row_seed, row_seeds, row_uniforms
from megarl.workers.roles import RolloutRole
from megarl.workers.specs import RolloutSpec

pytestmark = pytest.mark.unit

R = 8
# Four prompts, the first and the third the same: a batch that DP=2 splits into two equal shards.
BATCH = [[5, 17, 42, 8], [33, 2], [5, 17, 42, 8], [71, 70, 69, 68, 67, 3]]


@pytest.fixture(scope="module")
def model64() -> torch.nn.Module:
    """float64, so that the same row decoded in batches of other shapes rounds alike far below what
    a sampled token could turn on (the comparisons across splits are exact)."""
    return tiny_model(seed=2).double()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_seeds")
    tiny_model(seed=2).save_pretrained(out, safe_serialization=True)
    return out


def engine_of(model: torch.nn.Module, seed: int = 0) -> HFRolloutEngine:
    return HFRolloutEngine(copy.deepcopy(model), EngineOptions(pad_token_id=PAD, eos_token_ids=(), seed=seed))


def rows(batch: Batch) -> list[tuple[int, ...]]:
    return [tuple(r) for r in batch["responses"].tolist()]


def test_mix64_is_splitmix64s_finaliser() -> None:
    # SplitMix64 seeded with 0 outputs mix(0 + GAMMA) first: 0xE220A8397B1DCDAF (its published sequence)
    assert mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert mix64(-1) == mix64(2**64 - 1)


def test_row_seeds_are_consecutive_from_a_hash_of_the_call_seed() -> None:
    assert row_seeds(11, range(3, 7)).tolist() == [row_seed(11, r) for r in range(3, 7)]
    assert row_seeds(11, [9, 2]).tolist() == [row_seed(11, 9), row_seed(11, 2)]
    assert all(0 <= row_seed(s, r) < SEED_SPACE for s in (-5, 0, 2**70) for r in (0, 10**6))
    # nearby call seeds (seed + attempt, + 7919 x chunk, ...) start far apart
    bases = [call_base(s) for s in range(1000)]
    assert len(set(bases)) == 1000
    assert min(abs(a - b) for a, b in zip(sorted(bases), sorted(bases)[1:])) > 2**40


def test_dapo_attempts_and_steps_share_no_row_stream() -> None:
    """The driver seeds a training call with one seed per (step, attempt); before, request i of
    a call took seed + i * n and its samples seed + i * n + c, so attempt a + 1 (seed + 2) drew the
    streams of attempt a's rows 2, 3, ... With n = 4 and 64 prompts per call none is shared now,
    not even in the low 32 bits that torch's CPU generator (vLLM on CPU) keeps of a seed."""
    n, prompts = 4, 64
    seen: dict[int, tuple[int, int]] = {}
    low32: set[int] = set()
    for step in range(3):
        for attempt in range(4):
            call = 3 * 100003 + 2 * (step * 1000 + attempt)  # as `RLTrainer.sampling` forms it
            for row in range(prompts * n):
                key = row_seed(call, row)
                assert key not in seen, (step, attempt, row, seen.get(key))
                seen[key] = (step, attempt)
                low32.add(key % 2**32)
    assert len(low32) == len(seen)


def test_row_uniforms_are_a_function_of_seed_and_draw_index() -> None:
    seeds = row_seeds(7, range(5))
    whole = row_uniforms(seeds, 0, 100)
    assert whole.shape == (5, 100) and ((whole >= 0) & (whole < 1)).all()
    assert np.array_equal(row_uniforms(seeds, 37, 20), whole[:, 37:57])  # any chunk alone
    assert np.array_equal(row_uniforms(seeds[2:4], 0, 100), whole[2:4])  # any subset of rows alone
    many = row_uniforms(row_seeds(1, range(200)), 0, 500)
    assert abs(many.mean() - 0.5) < 0.005 and abs(many.var() - 1 / 12) < 0.002
    assert abs(np.corrcoef(many[:, :-1].ravel(), many[:, 1:].ravel())[0, 1]) < 0.01  # draw to draw
    assert abs(np.corrcoef(many[:-1].ravel(), many[1:].ravel())[0, 1]) < 0.01  # neighbouring rows


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zero_mass() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    u = torch.from_numpy(row_uniforms(row_seeds(3, [0]), 0, 40000)[0])
    tokens = inverse_cdf_sample(probs.expand(len(u), -1), u)
    counts = torch.bincount(tokens, minlength=6).double() / len(u)
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts, probs.double(), atol=0.01, rtol=0)
    # the ends of [0, 1): the first and the last token of positive mass
    edges = inverse_cdf_sample(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64))
    assert edges.tolist() == [1, 4]
    # through sample_next_tokens: the processed log-prob of the token drawn
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    token, log_prob = sample_next_tokens(logits, SamplingParams(top_k=2), "processed",
                                         uniforms=torch.tensor([0.99]))
    assert token.item() == 1
    assert log_prob.item() == pytest.approx(1.0 - float(torch.logsumexp(torch.tensor([2.0, 1.0]), 0)), abs=1e-6)


def test_ranks_given_the_same_prompts_and_seed_sample_apart_and_each_reproduces(model64: torch.nn.Module) -> None:
    """DP ranks get the same call seed; before, row i of every rank drew the same random numbers,
    so one prompt on two ranks got the same responses. Each rank's rows now have streams of their
    own, and a rank asked again samples what it sampled."""
    prompts = prompt_batch([BATCH[0], BATCH[0]])
    params = SamplingParams(n=2, max_new_tokens=R, temperature=1.5, seed=123)
    rank0 = engine_of(model64).generate(prompts, params)
    rank1 = engine_of(model64).generate(prompts, SamplingParams(**{**params.__dict__, "row_offset": len(prompts)}))
    assert len(set(rows(rank0))) == 4  # two prompts alike, n = 2: four samples, all different
    assert not set(rows(rank0)) & set(rows(rank1))
    again = engine_of(model64, seed=9).generate(prompts, params)  # the engine's own seed plays no part
    assert rows(again) == rows(rank0)
    assert torch.equal(again["rollout_log_probs"], rank0["rollout_log_probs"])


def test_a_seeded_batch_samples_the_same_rows_whatever_its_split(model64: torch.nn.Module) -> None:
    """The whole batch on one engine, or its halves on two engines that know where their shard
    starts (`row_offset`), or one prompt at a time: row for row the same samples."""
    params = SamplingParams(n=3, max_new_tokens=R, temperature=1.5, seed=77)
    whole = engine_of(model64).generate(prompt_batch(BATCH), params)
    halves = [engine_of(model64).generate(prompt_batch(BATCH[2 * d:2 * d + 2]),
                                          SamplingParams(**{**params.__dict__, "row_offset": 2 * d}))
              for d in range(2)]
    assert rows(whole) == rows(halves[0]) + rows(halves[1])
    singles = [engine_of(model64).generate(prompt_batch([p]), SamplingParams(**{**params.__dict__, "row_offset": i}))
               for i, p in enumerate(BATCH)]
    assert rows(whole) == [r for out in singles for r in rows(out)]
    # prompts 0 and 2 are the same prompt: their samples differ
    assert not set(rows(whole)[0:3]) & set(rows(whole)[6:9])


def test_the_token_in_token_out_call_gives_each_context_its_own_stream(model64: torch.nn.Module) -> None:
    contexts = [BATCH[0]] * 4
    params = SamplingParams(max_new_tokens=R, temperature=1.5, seed=5)
    engine = engine_of(model64)
    out = engine.generate_tokens(contexts, params)
    assert len({tuple(c.token_ids) for c in out}) == 4
    shifted = engine.generate_tokens(contexts[:2], SamplingParams(**{**params.__dict__, "row_offset": 2}))
    assert [c.token_ids for c in shifted] == [c.token_ids for c in out[2:]]


def test_a_call_on_some_of_the_requests_keeps_each_on_its_own_stream(model64: torch.nn.Module) -> None:
    """An agent loop's later turn or a partial rollout's continuation runs only the requests still
    open: `prompt_indices` names each one's index in the whole batch, so each samples as it would
    have in a call on all of them (before, they sampled from the streams of the first rows)."""
    contexts = [BATCH[0]] * 4
    params = SamplingParams(max_new_tokens=R, temperature=1.5, seed=5, row_offset=6)
    engine = engine_of(model64)
    every = engine.generate_tokens(contexts, params)
    some = engine.generate_tokens([contexts[1], contexts[3]], params.for_prompts(4, [1, 3]))
    assert [c.token_ids for c in some] == [every[1].token_ids, every[3].token_ids]
    assert params.for_prompts(4, [1, 3]).batch_indices(2) == [7, 9]
    assert params.for_prompts(4, [1, 3]).for_prompts(2, [1]).prompt_indices == (9,)
    # n > 1: prompt index p's samples are rows p x n + c, as in a call on every prompt
    two = SamplingParams(n=2, max_new_tokens=R, temperature=1.5, seed=5)
    whole = engine.generate(prompt_batch(BATCH), two)
    picked = engine.generate(prompt_batch([BATCH[1], BATCH[3]]), two.for_prompts(4, [1, 3]))
    assert rows(picked) == rows(whole)[2:4] + rows(whole)[6:8]
    # interrupted decoding (the base class chunks through generate_tokens; the HF engine keeps one loop)
    chunked = RolloutEngine.generate_interruptible(engine, [contexts[1], contexts[3]], params.for_prompts(4, [1, 3]),
                                                   [R, R], every=3, interrupted=lambda checks: False)
    whole_chunked = RolloutEngine.generate_interruptible(engine, contexts, params, [R] * 4, every=3,
                                                         interrupted=lambda checks: False)
    assert [c.token_ids for c in chunked] == [whole_chunked[1].token_ids, whole_chunked[3].token_ids]
    with pytest.raises(ValueError, match="prompt_indices names 2 prompts, the call has 3"):
        engine.generate_tokens(contexts[:3], params.for_prompts(4, [1, 3]))
    with pytest.raises(ConfigError, match="prompt_indices must be >= 0"):
        SamplingParams(prompt_indices=(0, -1))


def make_role(path: Path, rank: int, tp: int = 1) -> RolloutRole:
    options = EngineOptions(pad_token_id=PAD, eos_token_ids=(), seed=5)
    role = RolloutRole(SimpleNamespace(rank=rank),
                       RolloutSpec(model_dir=str(path), engine="hf", options=options, tensor_parallel_size=tp))
    role.init_engine()
    return role


def test_rollout_roles_of_two_dp_ranks_sample_their_shards_as_one_rank_samples_the_batch(model_dir: Path) -> None:
    """The driver sends every rollout rank the same sampling (one seed) and its shard of the batch
    (`call_dp`: equal runs of consecutive rows). The two ranks' rows are those of the whole batch
    sampled at DP=1, and rank 1 given rank 0's shard samples it differently."""
    params = SamplingParams(n=2, max_new_tokens=R, temperature=1.5, seed=2024)
    whole = make_role(model_dir, 0).generate(prompt_batch(BATCH), params)
    rank0, rank1 = make_role(model_dir, 0), make_role(model_dir, 1)
    first = rank0.generate(prompt_batch(BATCH[:2]), params)
    second = rank1.generate(prompt_batch(BATCH[2:]), params)
    # float32: a row decoded in another batch shape may round its probabilities differently (~1e-7),
    # which turns a sampled token only when its uniform lies that close to a boundary: never here
    assert rows(first) + rows(second) == rows(whole)
    same_shard = rank1.generate(prompt_batch(BATCH[:2]), params)
    assert not set(rows(same_shard)) & set(rows(first))
    assert rows(rank1.generate(prompt_batch(BATCH[:2]), params)) == rows(same_shard)  # and reproduces
    # the TP ranks of one engine share its data-parallel rank, hence its streams
    assert [make_role(model_dir, r, tp=2).dp_rank for r in range(4)] == [0, 0, 1, 1]


def test_unseeded_calls_draw_from_the_engines_own_stream(model64: torch.nn.Module) -> None:
    prompts = prompt_batch(BATCH[:2])
    params = SamplingParams(n=2, max_new_tokens=R, temperature=1.5)
    a, b = engine_of(model64, seed=1), engine_of(model64, seed=1)
    first = [rows(a.generate(prompts, params)) for _ in range(2)]
    assert first[0] != first[1]
    assert [rows(b.generate(prompts, params)) for _ in range(2)] == first
    assert rows(engine_of(model64, seed=2).generate(prompts, params)) != first[0]
