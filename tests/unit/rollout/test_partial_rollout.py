"""Partial rollout (`megarl.rollout.partial`) over the real HF engine of a tiny random Qwen2: rows
generated in chunks, interrupted, continued after a weight update (or dropped), each token with
the version and the log-prob of the weights that sampled it, checked against float64 forwards of
the two models over the unpadded sequences."""

from __future__ import annotations

import copy
import pytest
import torch
from rollout_helpers import PAD, PROMPTS, argmax_decode, kept_response, prompt_batch, reference_log_softmax, tiny_model

from megarl.protocol import Batch
from megarl.rollout import EngineOptions, SamplingParams
from megarl.rollout.base import RolloutEngine
from megarl.rollout.hf_engine import HFRolloutEngine
from megarl.rollout.partial import (
    OPEN, TOKEN_VERSIONS, WeightSignal, advance_rows, oldest_versions, open_rows, partial_metrics,
)

pytestmark = pytest.mark.unit

R = 6
N = 2


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    return tiny_model(seed=0), tiny_model(seed=1)


def engine_of(model: torch.nn.Module, eos: tuple[int, ...] = ()) -> HFRolloutEngine:
    copy = tiny_model(seed=0)
    copy.load_state_dict(model.state_dict())
    return HFRolloutEngine(copy, EngineOptions(pad_token_id=PAD, eos_token_ids=eos))


def never(chunks: int) -> bool:
    return False


def after(k: int):
    return lambda chunks: chunks >= k


def token_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    ref = reference_log_softmax(model, prompt, response)
    return ref[torch.arange(len(response)), torch.tensor(response)]


def test_uninterrupted_chunks_give_whole_responses_with_their_log_probs(models) -> None:
    old, _ = models
    engine = engine_of(old)
    rows = open_rows(prompt_batch(PROMPTS), N, R, PAD)
    assert len(rows) == len(PROMPTS) * N and rows[OPEN].tolist() == [1] * len(rows)
    out = advance_rows(engine, rows, SamplingParams(n=N, max_new_tokens=R, seed=5), version=3, chunk_tokens=4,
                       interrupted=never)
    assert out[OPEN].tolist() == [0] * len(out)
    assert out["response_mask"].sum(-1).tolist() == [R] * len(out)  # no EOS: every row runs to R
    assert (out[TOKEN_VERSIONS] == 3).all() and oldest_versions(out).tolist() == [3] * len(out)
    for row in range(len(out)):
        prompt, response = PROMPTS[row // N], kept_response(out, row)
        torch.testing.assert_close(out["rollout_log_probs"][row].double(), token_log_probs(old, prompt, response),
                                   atol=1e-5, rtol=0)
        # The trainer's columns agree with the new tokens.
        p = out["prompts"].shape[1]
        assert out["input_ids"][row, p:].tolist() == out["responses"][row].tolist()
        assert out["attention_mask"][row, p:].tolist() == out["response_mask"][row].tolist()
    assert out["uid"].tolist() == [f"prompt-{i // N}" for i in range(len(out))]


def test_greedy_chunks_equal_one_uncached_decode(models) -> None:
    # float64: greedy tokens against an uncached loop must not hinge on float32 rounding (a near-tie)
    old = copy.deepcopy(models[0]).double()
    rows = open_rows(prompt_batch(PROMPTS), 1, R, PAD)
    out = advance_rows(engine_of(old), rows, SamplingParams.make_greedy(R), 0, chunk_tokens=2, interrupted=never)
    for row, prompt in enumerate(PROMPTS):
        assert kept_response(out, row) == argmax_decode(old, prompt, R)


def test_interrupted_rows_continue_with_the_new_weights(models) -> None:
    old, new = models
    # The token row 0 decodes second (greedy) ends a response: row 0 stops inside the first chunk.
    eos = argmax_decode(old, PROMPTS[0], 2)[1]
    engine = engine_of(old, eos=(eos,))
    greedy = SamplingParams.make_greedy(R)
    first = advance_rows(engine, open_rows(prompt_batch(PROMPTS), 1, R, PAD), greedy, 0, chunk_tokens=2,
                         interrupted=after(1))
    lengths = first["response_mask"].sum(-1).tolist()
    assert lengths[0] == 2 and first[OPEN].tolist()[0] == 0
    for row in range(1, len(PROMPTS)):  # open rows stop after one chunk unless they hit the EOS
        ended = eos in kept_response(first, row)
        assert first[OPEN].tolist()[row] == int(not ended) and (ended or lengths[row] == 2), row

    engine.update_weights(new.state_dict().items())
    done = advance_rows(engine, first, greedy, 1, chunk_tokens=2, interrupted=never)
    assert done[OPEN].tolist() == [0] * len(PROMPTS)
    for row, prompt in enumerate(PROMPTS):
        response = kept_response(done, row)
        k = lengths[row]
        assert response[:k] == kept_response(first, row)  # the tokens sampled before stay
        versions = done[TOKEN_VERSIONS][row, :len(response)].tolist()
        assert versions == [0] * k + [1] * (len(response) - k), row
        # Old tokens carry the old model's log-probs, new ones the new model's (its KV cache rebuilt).
        expected = torch.cat([token_log_probs(old, prompt, response)[:k], token_log_probs(new, prompt, response)[k:]])
        torch.testing.assert_close(done["rollout_log_probs"][row, :len(response)].double(), expected, atol=1e-5, rtol=0)
        if k < len(response):  # the continuation is the new model's greedy decode of the same prefix
            assert response[k:] == argmax_decode(new, prompt + response[:k], len(response) - k)[:len(response) - k]
    assert oldest_versions(done).tolist() == [0] * len(PROMPTS)


def test_drop_samples_unfinished_rows_again_with_the_new_weights(models) -> None:
    old, new = models
    engine = engine_of(old)
    greedy = SamplingParams.make_greedy(R)
    first = advance_rows(engine, open_rows(prompt_batch(PROMPTS), 1, R, PAD), greedy, 0, chunk_tokens=2,
                         interrupted=after(1))
    assert first[OPEN].tolist() == [1] * len(PROMPTS) and first["response_mask"].sum().item() == 2 * len(PROMPTS)
    engine.update_weights(new.state_dict().items())
    done = advance_rows(engine, first, greedy, 1, chunk_tokens=4, interrupted=never, restart_stale=True)
    for row, prompt in enumerate(PROMPTS):
        assert kept_response(done, row) == argmax_decode(new, prompt, R)
        assert done[TOKEN_VERSIONS][row].tolist() == [1] * R


def test_default_chunks_draw_their_own_random_numbers(models) -> None:
    """The default `generate_interruptible` (chunks through `generate_tokens`, as the vLLM engine
    runs it), sampling at a temperature so high that every token is close to uniform: chunks seeded
    alike would repeat the same tokens at the same offset of every chunk."""
    old, _ = models
    hot = SamplingParams(n=1, temperature=1e4, max_new_tokens=24, seed=11)
    out = RolloutEngine.generate_interruptible(engine_of(old), [[5, 6]] * 4, hot, [24] * 4, 6, never)
    chunks = torch.tensor([c.token_ids for c in out]).reshape(4, 4, 6)
    assert not all(torch.equal(chunks[:, 0], chunks[:, c]) for c in range(1, 4))


@pytest.mark.parametrize("checks", [1, 2, None])
def test_the_hf_decoding_loop_stops_where_the_default_chunks_do(models, checks) -> None:
    """The HF engine checks inside its decoding loop (KV cache kept); the default generates chunks.
    Greedy, both give the same tokens, budgets and stops, and log-probs equal within float32."""
    old, _ = models
    eos = argmax_decode(old, PROMPTS[0], 3)[2]  # row 0 ends at its third token
    engine = engine_of(old, eos=(eos,))
    contexts, budgets = PROMPTS, [R, 4, R]
    stop = never if checks is None else after(checks)
    loop = engine.generate_interruptible(contexts, SamplingParams.make_greedy(R), budgets, 2, stop)
    chunked = RolloutEngine.generate_interruptible(engine, contexts, SamplingParams.make_greedy(R), budgets, 2, stop)
    for row, (a, b) in enumerate(zip(loop, chunked)):
        assert a.token_ids == b.token_ids and a.stopped == b.stopped, row
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
        whole = argmax_decode(old, contexts[row], budgets[row])
        ended = whole.index(eos) + 1 if eos in whole else budgets[row]
        expected = min(ended, budgets[row], 2 * checks if checks else R)
        assert a.token_ids == whole[:expected] and a.stopped == (eos in whole[:expected]), row


def test_partial_metrics_worked_by_hand() -> None:
    batch = Batch.from_dict({
        "response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
        TOKEN_VERSIONS: torch.tensor([[4, 4, 5, -1], [5, 5, -1, -1], [3, 4, 4, 5]]),
    })
    m = partial_metrics(batch, trained_with=5)
    # staleness per token: row 0: 1 1 0; row 1: 0 0; row 2: 2 1 1 0 -> sum 6 over 9 tokens
    assert m["async/token_staleness_mean"] == pytest.approx(6 / 9)
    assert m["async/token_staleness_max"] == 2.0
    assert m["async/partial_rows"] == pytest.approx(2 / 3)
    assert oldest_versions(batch).tolist() == [4, 5, 3]
    assert partial_metrics(Batch.from_dict({"response_mask": torch.ones(1, 2)}), 1) == {}


def test_weight_signal_counts_up_to_the_newest_version() -> None:
    server = WeightSignal.serve("127.0.0.1")
    reader = WeightSignal.connect(*server.address)
    assert reader.newest() == 0
    server.raise_to(3)
    assert reader.newest() == 3
    server.raise_to(2)  # never lowered
    server.raise_to(5)
    assert reader.newest() == 5


def test_open_rows_keep_their_own_random_streams_whichever_rows_closed(models) -> None:
    """Only the open rows go to the engine; each still samples from the stream of its index in the
    batch (before, the k-th open row took row k's), so a seeded continuation does not depend on
    which other rows finished (nor on how the batch was split over ranks)."""
    old, _ = models
    sampling = SamplingParams(n=1, temperature=1.5, max_new_tokens=R, seed=21)
    rows = open_rows(prompt_batch(PROMPTS), 2, R, PAD)
    every = advance_rows(engine_of(old), rows, sampling, version=0, chunk_tokens=4, interrupted=never)
    some = rows.select(*rows.keys())
    closed = [0, 2]
    some[OPEN] = torch.tensor([int(i not in closed) for i in range(len(rows))])
    part = advance_rows(engine_of(old), some, sampling, version=0, chunk_tokens=4, interrupted=never)
    for row in range(len(rows)):
        expected = [] if row in closed else kept_response(every, row)
        assert kept_response(part, row) == expected, row
    assert len({tuple(kept_response(every, row)) for row in range(len(rows))}) == len(rows)
