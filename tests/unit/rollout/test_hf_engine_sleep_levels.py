"""HF rollout engine sleep levels: level 2 frees the weight storages (measured by storage bytes and
by the process RSS) and refuses to generate until a weight sync has rewritten every weight; level 1
keeps the weights on CPU. Generation after wake + sync is compared bit for bit with generation
before the sleep, and greedy output with a plain uncached argmax decoder."""

from __future__ import annotations

import gc
import mmap
import re
from pathlib import Path

import psutil
import pytest
import torch
from rollout_helpers import PAD, PROMPTS, VOCAB, argmax_decode, kept_response, prompt_batch, tiny_model

from megarl.errors import ConfigError
from megarl.protocol import Batch
from megarl.rollout import (
    EngineOptions,
    EngineState,
    RolloutStateError,
    SamplingParams,
    WeightUpdateError,
    create_rollout_engine,
)
from megarl.rollout.hf_engine import HFRolloutEngine

pytestmark = pytest.mark.unit

LEVEL2 = EngineOptions(pad_token_id=PAD, eos_token_ids=())
LEVEL1 = EngineOptions(pad_token_id=PAD, eos_token_ids=(), sleep_level=1)
GREEDY = SamplingParams.make_greedy(6)
SEEDED = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=11)


def storage_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the storages under the model's parameters (each storage counted once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())  # freed storages all sit at address 0 with 0 bytes


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights need, from shapes alone (tied parameters counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def outputs(engine: HFRolloutEngine) -> dict[str, Batch]:
    return {"greedy": engine.generate(prompt_batch(PROMPTS), GREEDY),
            "seeded": engine.generate(prompt_batch(PROMPTS), SEEDED)}


def assert_identical(got: dict[str, Batch], want: dict[str, Batch]) -> None:
    for mode in want:
        for column in ("responses", "response_mask", "rollout_log_probs"):
            assert torch.equal(got[mode][column], want[mode][column]), (mode, column)


def saved_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_sleep_level_is_validated_and_defaults_to_discarding() -> None:
    assert LEVEL2.sleep_level == 2
    with pytest.raises(ConfigError, match="sleep_level must be 1 or 2, got 3"):
        EngineOptions(pad_token_id=PAD, eos_token_ids=(), sleep_level=3)
    engine = HFRolloutEngine(tiny_model(seed=0), LEVEL2)
    assert engine.sleep_discards_weights and engine.sleep_frees_memory and not engine.needs_weight_sync
    engine = HFRolloutEngine(tiny_model(seed=0), LEVEL1)
    assert not engine.sleep_discards_weights and not engine.sleep_frees_memory  # CPU: nothing to free


def test_level2_sleep_returns_the_weight_memory_to_the_os() -> None:
    # ~69 MB of float32 weights: far above the RSS noise of a pytest process (a few MB).
    torch.manual_seed(0)
    model = tiny_model(seed=0, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    needed = weight_bytes(model)
    assert needed > 60 * 2**20
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)  # every weight page touched and resident
    assert storage_bytes(model) == needed
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    gc.collect()
    process = psutil.Process()
    rss_awake = process.memory_info().rss
    engine.sleep()
    rss_asleep = process.memory_info().rss
    drop = rss_awake - rss_asleep
    print(f"weights {needed / 2**20:.1f} MiB; RSS {rss_awake / 2**20:.1f} -> {rss_asleep / 2**20:.1f} MiB, "
          f"drop {drop / 2**20:.1f} MiB = {drop / needed:.0%} of the weights")
    assert storage_bytes(model) == 0
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    # On CPU each weight storage is a memory mapping of its own, unmapped by the sleep. With the
    # weights in the C heap the drop was 0% in this test (78% in a fresh process): glibc keeps
    # freed chunks that were allocated below its adaptive mmap threshold. 80% allows for page
    # granularity and unrelated allocations between the two readings.
    assert drop >= 0.8 * needed
    # Non-persistent buffers are not rewritten by a weight sync, so they must survive the sleep.
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)

    state = saved_state(tiny_model(seed=0, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64))
    engine.wake_up(("weights",))
    assert storage_bytes(model) == needed
    engine.update_weights(state.items())
    engine.wake_up()
    assert_identical(outputs(engine), before)


def test_level2_on_cpu_keeps_each_weight_storage_in_a_mapping_of_its_own() -> None:
    # Freed by unmapping, the weights leave the C heap alone: a trim of the whole heap (the way
    # before) also handed back the memory the training step of the same process reuses.
    model = tiny_model(seed=0, tie_word_embeddings=True)
    state = saved_state(model)
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)

    def mapped() -> bool:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in model.parameters()}
        return all(not st.resizable() and ptr % mmap.PAGESIZE == 0 for ptr, st in storages.items())

    assert mapped()
    engine.sleep()
    engine.wake_up(("weights",))
    assert mapped()
    state.pop("lm_head.weight")  # tied: one name rewrites the shared storage
    engine.update_weights(state.items())
    engine.wake_up()
    assert_identical(outputs(engine), before)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_wake_and_full_update_generate_exactly_as_before(tied: bool) -> None:
    model = tiny_model(seed=0, tie_word_embeddings=tied)
    state = saved_state(model)
    reference = [argmax_decode(tiny_model(seed=0, tie_word_embeddings=tied), prompt, GREEDY.max_new_tokens)
                 for prompt in PROMPTS]
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)
    assert [kept_response(before["greedy"], i) for i in range(len(PROMPTS))] == reference

    engine.sleep()
    assert storage_bytes(model) == 0
    with pytest.raises(RolloutStateError, match="cannot generate while asleep"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)
    with pytest.raises(RolloutStateError, match="cannot update weights while asleep"):
        engine.update_weights(state.items())
    engine.wake_up(("weights",))
    assert engine.needs_weight_sync and storage_bytes(model) == weight_bytes(model)
    with pytest.raises(RolloutStateError, match="cannot generate while weights_only"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)
    if tied:  # the sync sends one name for the shared tensor; either name rewrites it
        state.pop("lm_head.weight")
    assert engine.update_weights(state.items()) == len(state)
    assert not engine.needs_weight_sync
    engine.wake_up()
    assert_identical(outputs(engine), before)
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight


def test_tied_weights_can_be_rewritten_under_the_lm_head_name() -> None:
    model = tiny_model(seed=0, tie_word_embeddings=True)
    state = saved_state(model)
    state.pop("model.embed_tokens.weight")
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)
    engine.sleep()
    engine.wake_up()
    engine.update_weights(state.items())
    assert_identical(outputs(engine), before)


def test_generate_before_the_sync_says_the_weights_were_discarded() -> None:
    model = tiny_model(seed=0)
    state = saved_state(model)
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)
    engine.sleep()
    engine.wake_up()  # everything back, contents undefined
    assert engine.state is EngineState.AWAKE
    with pytest.raises(RolloutStateError, match=r"weights were discarded by sleep \(sleep_level=2\) and a "
                                                r"weight sync must run first"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)

    later = ("model.layers.1.mlp.down_proj.weight", "model.norm.weight")
    engine.update_weights((name, t) for name, t in state.items() if name not in later)
    assert engine.needs_weight_sync
    with pytest.raises(RolloutStateError, match=r"still missing 2: model\.layers\.1\.mlp\.down_proj\.weight, "
                                                r"model\.norm\.weight$"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)

    # A new sleep discards the partial sync: every weight is missing again after the next wake-up.
    engine.sleep()
    engine.wake_up()
    engine.update_weights((name, state[name]) for name in later)
    with pytest.raises(RolloutStateError, match=f"still missing {len(state) - 2}: lm_head.weight"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)
    engine.update_weights((name, t) for name, t in state.items() if name not in later)
    assert not engine.needs_weight_sync
    assert_identical(outputs(engine), before)


def test_in_place_copies_then_mark_weights_updated() -> None:
    model = tiny_model(seed=0)
    state = saved_state(model)
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)
    engine.sleep()
    engine.wake_up(("weights",))
    with torch.no_grad():
        for name, param in engine.engine_model().named_parameters():
            param.copy_(state[name])
    assert engine.needs_weight_sync  # the engine cannot see direct copies
    engine.mark_weights_updated()
    engine.wake_up()
    assert_identical(outputs(engine), before)


def test_sleep_again_before_the_sync_frees_again() -> None:
    model = tiny_model(seed=0)
    state = saved_state(model)
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)
    engine.sleep()
    engine.wake_up(("weights",))
    engine.sleep()
    assert engine.state is EngineState.ASLEEP and storage_bytes(model) == 0
    engine.wake_up(("weights",))
    engine.update_weights(state.items())
    engine.wake_up()
    assert_identical(outputs(engine), before)


def test_level2_frees_memory_mapped_weights_of_a_loaded_model(tmp_path: Path) -> None:
    # from_pretrained leaves the safetensors tensors in storages that cannot be resized.
    tiny_model(seed=3).save_pretrained(tmp_path / "model")
    engine = create_rollout_engine("hf", tmp_path / "model", LEVEL2)
    model = engine.engine_model()
    needed = weight_bytes(model)
    state = saved_state(model)
    before = outputs(engine)
    engine.sleep()
    assert storage_bytes(model) == 0
    engine.wake_up(("weights",))
    assert storage_bytes(model) == needed
    engine.update_weights(state.items())
    engine.wake_up()
    assert_identical(outputs(engine), before)


def test_level1_on_cpu_keeps_the_weights() -> None:
    model = tiny_model(seed=0)
    engine = HFRolloutEngine(model, LEVEL1)
    before = outputs(engine)
    pointers = [p.data_ptr() for p in model.parameters()]
    engine.sleep()
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert storage_bytes(model) == weight_bytes(model)
    engine.wake_up(("weights",))
    engine.wake_up()
    assert not engine.needs_weight_sync
    assert_identical(outputs(engine), before)


def tiny_moe_model(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False, pad_token_id=PAD,
        eos_token_id=None, bos_token_id=None,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def per_expert_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names: one gate/up/down matrix per expert."""
    out = {}
    for name, tensor in model.state_dict().items():
        fused = re.fullmatch(r"(.+\.experts)\.(gate_up_proj|down_proj)", name)
        if fused is None:
            out[name] = tensor.clone()
            continue
        for e in range(tensor.shape[0]):
            if fused[2] == "down_proj":
                out[f"{fused[1]}.{e}.down_proj.weight"] = tensor[e].clone()
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{fused[1]}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{fused[1]}.{e}.up_proj.weight"] = up.clone()
    return out


def test_fused_experts_count_as_rewritten_once_every_expert_is_named() -> None:
    model = tiny_moe_model(seed=0)
    state = per_expert_state(model)
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)
    engine.sleep()
    engine.wake_up()
    last = "model.layers.1.mlp.experts.3.up_proj.weight"
    engine.update_weights((name, t) for name, t in state.items() if name != last)
    with pytest.raises(RolloutStateError, match=rf"still missing 1: {re.escape(last)}$"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)
    engine.update_weights([(last, state[last])])
    assert_identical(outputs(engine), before)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "fused_experts"])
def test_weight_targets_are_the_model_tensors_a_sync_writes_in_place(moe: bool) -> None:
    """`weight_targets`: the model's own tensors under the update names (one expert of a fused
    expert parameter a view of it), so a weight sync writes into them with no copy of the model;
    `weights_written` counts them as `update_weights` would, name by name."""
    model = tiny_moe_model(seed=0) if moe else tiny_model(seed=0)
    state = per_expert_state(model) if moe else saved_state(model)
    engine = HFRolloutEngine(model, LEVEL2)
    before = outputs(engine)
    engine.sleep()
    with pytest.raises(RolloutStateError, match="cannot update weights while asleep"):
        engine.weight_targets({name: tuple(t.shape) for name, t in state.items()})
    engine.wake_up()
    targets = engine.weight_targets({name: tuple(t.shape) for name, t in state.items()})
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert sorted(targets) == sorted(state)
    assert all(t.untyped_storage().data_ptr() in storages for t in targets.values())
    last = sorted(state)[-1]
    for name, target in targets.items():
        target.copy_(state[name])
    engine.weights_written(name for name in state if name != last)
    with pytest.raises(RolloutStateError, match=rf"still missing 1: {re.escape(last)}$"):
        engine.generate(prompt_batch(PROMPTS), GREEDY)
    engine.weights_written([last])
    assert not engine.needs_weight_sync
    assert_identical(outputs(engine), before)


def test_weight_targets_name_an_unknown_or_misshapen_parameter() -> None:
    engine = HFRolloutEngine(tiny_model(seed=0), LEVEL1)
    with pytest.raises(WeightUpdateError, match=r"unknown parameter 'model\.layers\.0\.self_attn\.qkv_proj\.weight'"):
        engine.weight_targets({"model.layers.0.self_attn.qkv_proj.weight": (3,)})
    with pytest.raises(WeightUpdateError, match=r"'model\.norm\.weight' has shape \(64,\), the update gives \(65,\)"):
        engine.weight_targets({"model.norm.weight": (65,)})
