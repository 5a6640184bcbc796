"""The HF engine's linear layers on oneDNN-packed weights (`PackedLinear`): the same numbers as a
float64 product within the dtype's error bound, never a stale pack after any kind of weight change,
plain `nn.Linear` behaviour outside inference mode, and copies of the model that still work."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from rollout_helpers import PAD, PROMPTS, prompt_batch, tiny_model, tiny_qwen2_config

from megarl.rollout import EngineOptions, SamplingParams
from megarl.rollout.hf_engine import PACK_MIN_HIDDEN_SIZE, PACK_MIN_NEW_TOKENS, HFRolloutEngine, PackedLinear, packs_linear_weights

pytestmark = pytest.mark.unit

OPTIONS = EngineOptions(pad_token_id=PAD, eos_token_ids=())
GREEDY = SamplingParams.make_greedy(PACK_MIN_NEW_TOKENS)  # long enough to make packs
CPU = torch.device("cpu")

needs_onednn = pytest.mark.skipif(not packs_linear_weights(CPU, torch.float32, PACK_MIN_HIDDEN_SIZE),
                                  reason="torch was built without oneDNN (mkldnn)")


@pytest.fixture
def pack_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny test model (hidden 64) is below the size the engine packs by default: pack it."""
    monkeypatch.setattr("megarl.rollout.hf_engine.PACK_MIN_HIDDEN_SIZE", 0)


def packed_modules(engine: HFRolloutEngine) -> list[PackedLinear]:
    return [m for m in engine.model.modules() if isinstance(m, PackedLinear)]


def new_state(engine: HFRolloutEngine, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.3 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
            for name, t in engine.model.state_dict().items()}


def expected_outputs(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Greedy responses and log-probs of a fresh engine built with `state` (its packs made from it)."""
    fresh = HFRolloutEngine.from_config(tiny_qwen2_config(), OPTIONS, state_dict=state, device="cpu")
    out = fresh.generate(prompt_batch(PROMPTS), GREEDY)
    return {"responses": out["responses"], "rollout_log_probs": out["rollout_log_probs"]}


def assert_generates(engine: HFRolloutEngine, expected: dict[str, torch.Tensor]) -> None:
    out = engine.generate(prompt_batch(PROMPTS), GREEDY)
    assert torch.equal(out["responses"], expected["responses"])
    torch.testing.assert_close(out["rollout_log_probs"], expected["rollout_log_probs"], atol=1e-6, rtol=0)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_layer_equals_float64_math_within_the_dtype_error_bound(dtype: torch.dtype) -> None:
    """Against the float64 product: a float32-accumulated dot product of K terms errs by at most
    K u32 sum|x w| (Higham's gamma_K, first order), and the output's rounding to `dtype` adds u |y|.
    Rows of a 3-d input and a non-contiguous one (the last position, as `logits_to_keep` slices it)."""
    if dtype == torch.bfloat16 and not packs_linear_weights(CPU, dtype, PACK_MIN_HIDDEN_SIZE):
        pytest.skip("this processor has no oneDNN bfloat16 kernels")
    generator = torch.Generator().manual_seed(0)
    k = 96
    layer = torch.nn.Linear(k, 40).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, k, generator=generator))
        layer.bias.copy_(torch.randn(40, generator=generator))
    layer.__class__ = PackedLinear
    x = torch.randn(3, 7, k, generator=generator).to(dtype)
    for inputs in (x, x[:, -1:, :]):
        with torch.inference_mode():
            y = layer(inputs)
        assert layer.pack is not None and y.dtype == dtype and y.shape == (*inputs.shape[:-1], 40)
        w64, x64 = layer.weight.detach().double(), inputs.double()
        exact = torch.nn.functional.linear(x64, w64, layer.bias.detach().double())
        magnitude = torch.nn.functional.linear(x64.abs(), w64.abs(), layer.bias.detach().double().abs())
        u32, u_out = 2.0**-24, (2.0**-24 if dtype == torch.float32 else 2.0**-8)
        bound = (k + 1) * u32 * magnitude * (1 + u_out) + u_out * exact.abs()
        assert bool(((y.double() - exact).abs() <= bound).all())


@needs_onednn
def test_outside_inference_mode_it_is_nn_linear_and_carries_gradients() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(16, 8)
    packed = copy.deepcopy(plain)
    packed.__class__ = PackedLinear
    x = torch.randn(4, 16, requires_grad=True)
    y = packed(x)
    assert packed.pack is None  # autograd: nn.Linear's own forward, nothing packed
    assert torch.equal(y, plain(x))
    y.sum().backward()
    assert packed.weight.grad is not None and torch.equal(packed.weight.grad, x.detach().sum(0).expand(8, 16))
    with torch.no_grad():
        assert torch.equal(packed(x), plain(x))
        assert packed.pack is None  # no_grad is not inference mode: the weight may still change under it


@needs_onednn
def test_the_engine_packs_its_linear_layers_and_keeps_the_state_dict(pack_any_size: None) -> None:
    model = tiny_model(seed=0)
    names = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    engine = HFRolloutEngine(model, OPTIONS)
    assert len(packed_modules(engine)) == linears == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    assert {name: tuple(t.shape) for name, t in engine.model.state_dict().items()} == names
    engine.generate(prompt_batch(PROMPTS), GREEDY)
    assert all(m.pack is not None for m in packed_modules(engine))


@needs_onednn
def test_every_way_of_changing_the_weights_reaches_the_packed_layers(pack_any_size: None) -> None:
    """After each change the engine generates what a fresh engine built with the new weights
    generates (and not what it generated before): an update, an in-place sync the engine is told of
    (written at the storage level, which no version counter sees), a write through the model it was
    not told of (caught by the version counter), and a discarding sleep, wake and update."""
    engine = HFRolloutEngine(tiny_model(seed=0), OPTIONS)
    before = engine.generate(prompt_batch(PROMPTS), GREEDY)

    state = new_state(engine, seed=1)
    engine.update_weights(state.items())
    expected = expected_outputs(state)
    assert not torch.equal(before["responses"], expected["responses"])
    assert_generates(engine, expected)

    state = new_state(engine, seed=2)
    targets = engine.weight_targets({name: t.shape for name, t in state.items()})
    with torch.no_grad():
        versions = {name: t._version for name, t in targets.items()}
        for name, target in targets.items():
            view = target.untyped_storage()[target.storage_offset() * 4:(target.storage_offset() + target.numel()) * 4]
            view.copy_(state[name].contiguous().untyped_storage())
        assert {name: t._version for name, t in targets.items()} == versions  # invisible to the version counters
    engine.weights_written(state)
    assert_generates(engine, expected_outputs(state))

    state = new_state(engine, seed=3)
    with torch.no_grad():
        for name, tensor in engine.engine_model().state_dict().items():
            tensor.copy_(state[name])
    assert_generates(engine, expected_outputs(state))

    engine.sleep()
    assert all(m.pack is None for m in packed_modules(engine))  # the packed copies are freed too
    engine.wake_up()
    state = new_state(engine, seed=4)
    engine.update_weights(state.items())
    assert_generates(engine, expected_outputs(state))


@needs_onednn
def test_a_packed_model_copies_pickles_and_releases(pack_any_size: None) -> None:
    engine = HFRolloutEngine(tiny_model(seed=0), OPTIONS)
    expected = engine.generate(prompt_batch(PROMPTS), GREEDY)
    for clone in (copy.deepcopy(engine.model), pickle.loads(pickle.dumps(engine.model))):
        layers = [m for m in clone.modules() if isinstance(m, PackedLinear)]
        assert layers and all(m.pack is None for m in layers)  # the copy packs its own weights
        twin = HFRolloutEngine(clone, OPTIONS)
        out = twin.generate(prompt_batch(PROMPTS), GREEDY)
        assert torch.equal(out["responses"], expected["responses"])
    engine.release()
    assert engine._packed_linears == []


def test_other_devices_dtypes_sizes_and_the_switch_leave_nn_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not packs_linear_weights(CPU, torch.float64, 4096)
    assert not packs_linear_weights(CPU, torch.float16, 4096)
    assert not packs_linear_weights(torch.device("cuda"), torch.float32, 4096)
    assert not packs_linear_weights(CPU, torch.float32, PACK_MIN_HIDDEN_SIZE - 1)
    assert not packs_linear_weights(CPU, torch.float32, None)
    with monkeypatch.context() as patch:
        patch.setattr(torch.backends.mkldnn, "enabled", False)
        assert not packs_linear_weights(CPU, torch.float32, 4096)
    assert torch.backends.mkldnn.enabled
    engine = HFRolloutEngine(tiny_model(seed=0), OPTIONS)  # hidden 64: packing would not pay
    assert not packed_modules(engine)
    monkeypatch.setattr("megarl.rollout.hf_engine.PACK_MIN_HIDDEN_SIZE", 0)
    monkeypatch.setattr("megarl.rollout.hf_engine.PACK_LINEAR_WEIGHTS", False)
    engine = HFRolloutEngine(tiny_model(seed=0), OPTIONS)
    assert not packed_modules(engine)
    assert sum(type(m) is torch.nn.Linear for m in engine.model.modules()) == 15


@needs_onednn
def test_a_model_of_the_size_that_pays_is_packed_and_short_calls_make_no_packs() -> None:
    """From `PACK_MIN_HIDDEN_SIZE` up the engine packs; after a weight change a call of fewer than
    `PACK_MIN_NEW_TOKENS` tokens multiplies on the plain weights (what it generates does not depend on
    it: the same as a fresh engine's long call), a longer one packs, and later short calls use the
    packs while they are current."""
    engine = HFRolloutEngine(tiny_model(seed=0, hidden_size=PACK_MIN_HIDDEN_SIZE, head_dim=64, num_attention_heads=8,
                                        num_key_value_heads=4), OPTIONS)
    layers = packed_modules(engine)
    assert len(layers) == 15
    short, long = SamplingParams.make_greedy(PACK_MIN_NEW_TOKENS - 1), SamplingParams.make_greedy(PACK_MIN_NEW_TOKENS)
    plain = engine.generate(prompt_batch(PROMPTS), short)
    assert all(m.pack is None for m in layers)
    packed = engine.generate(prompt_batch(PROMPTS), long)
    assert all(m.pack is not None for m in layers)
    assert torch.equal(packed["responses"][:, :PACK_MIN_NEW_TOKENS - 1], plain["responses"])
    again = engine.generate(prompt_batch(PROMPTS), short)
    assert all(m.pack is not None for m in layers)  # current packs serve short calls too
    assert torch.equal(again["responses"], plain["responses"])
    engine.update_weights(engine.model.state_dict().items())
    engine.generate(prompt_batch(PROMPTS), short)
    assert all(m.pack is None for m in layers)


@needs_onednn
def test_a_packed_engine_samples_log_probs_of_float64_math(pack_any_size: None) -> None:
    """Sampled tokens' log-probs of a packed float32 engine against one uncached forward pass of a
    float64 copy of the model over each prompt and response (no pack: float64 is not packed)."""
    model = tiny_model(seed=0)
    reference = copy.deepcopy(model).double()
    engine = HFRolloutEngine(model, OPTIONS)
    n = 2
    out = engine.generate(prompt_batch(PROMPTS), SamplingParams(n=n, max_new_tokens=PACK_MIN_NEW_TOKENS, seed=5))
    assert all(m.pack is not None for m in packed_modules(engine))
    for row in range(len(out)):
        prompt = PROMPTS[row // n]
        length = int(out["response_mask"][row].sum())
        response = out["responses"][row, :length].tolist()
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + response])).logits[0][len(prompt) - 1:-1]
        expected = torch.log_softmax(logits, dim=-1)[torch.arange(length), torch.tensor(response)]
        torch.testing.assert_close(out["rollout_log_probs"][row, :length].double(), expected, atol=1e-5, rtol=0)
