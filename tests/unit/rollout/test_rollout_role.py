"""The rollout role as the driver reaches it: engine from its spec, log-probs kept or dropped by
`rollout.calculate_log_probs`, sleep only with `rollout.free_cache_engine`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import prompt_batch, reference_log_softmax, tiny_model

from megarl.rollout.base import EngineOptions, EngineState, SamplingParams
from megarl.rollout.partial import OPEN, TOKEN_VERSIONS, PartialRollout, WeightSignal, open_rows
from megarl.workers.roles import RolloutRole
from megarl.workers.specs import RolloutSpec

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = tiny_model(seed=4)
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out, safe_serialization=True)
    return model, out


def make_role(path: Path, **spec: object) -> RolloutRole:
    options = EngineOptions(pad_token_id=0, eos_token_ids=(), seed=5)
    role = RolloutRole(SimpleNamespace(rank=0), RolloutSpec(model_dir=str(path), engine="hf", options=options, **spec))
    role.init_engine()
    return role


def test_log_probs_are_kept_or_dropped_as_configured(model_dir: tuple[torch.nn.Module, Path]) -> None:
    model, path = model_dir
    prompts = prompt_batch([[3, 4, 5], [6, 7]])
    params = SamplingParams(n=1, max_new_tokens=3, greedy=True)
    kept = make_role(path).generate(prompts, params)
    response = kept["responses"][0].tolist()
    with torch.no_grad():
        table = reference_log_softmax(model, [3, 4, 5], response)
    want = table[torch.arange(3), torch.tensor(response)]
    assert (kept["rollout_log_probs"][0].double() - want).abs().max() < 1e-5  # the sampled tokens' log-probs
    dropped = make_role(path, calculate_log_probs=False).generate(prompts, params)
    assert "rollout_log_probs" not in dropped and torch.equal(dropped["responses"], kept["responses"])


def test_sleep_follows_free_cache_engine(model_dir: tuple[torch.nn.Module, Path]) -> None:
    _, path = model_dir
    role = make_role(path)
    role.sleep()
    assert role.engine.state is EngineState.ASLEEP
    role.wake_up(("weights",))  # before a weight sync: weights only
    assert role.engine.state is EngineState.WEIGHTS_ONLY
    role.wake_up()
    assert role.engine.state is EngineState.AWAKE
    resident = make_role(path, free_cache_engine=False)
    resident.sleep()
    assert resident.engine.state is EngineState.AWAKE


def test_partial_generation_stops_when_the_driver_announces_newer_weights(
        model_dir: tuple[torch.nn.Module, Path]) -> None:
    _, path = model_dir
    signal = WeightSignal.serve("127.0.0.1")
    role = make_role(path, partial=PartialRollout(mode="continue", chunk_tokens=2))
    role.connect_weight_signal(*signal.address)
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    rows = open_rows(prompt_batch([[3, 4, 5], [6, 7]]), 2, 6, 0)
    # No newer weights than version 3: the rows run to their end.
    whole = role.generate_partial(rows, params, 3, interrupt_above=3)
    assert whole[OPEN].tolist() == [0] * 4 and whole["response_mask"].sum().item() == 24
    # Version 4 announced: the generation stops after its first chunk, 2 tokens a row.
    signal.raise_to(4)
    cut = role.generate_partial(rows, params, 3, interrupt_above=3)
    assert cut[OPEN].tolist() == [1] * 4 and cut["response_mask"].sum(-1).tolist() == [2] * 4
    # The continuation (interrupt_above None) is not interrupted, and records the new version.
    done = role.generate_partial(cut, params, 4, interrupt_above=None)
    assert done[OPEN].tolist() == [0] * 4 and done[TOKEN_VERSIONS].tolist() == [[3, 3, 4, 4, 4, 4]] * 4
    assert torch.equal(done["responses"][:, :2], cut["responses"][:, :2])
