"""A frozen engine (`EngineConfig.trained=False`: the reference policy, the reward model) holds its
parameters and nothing else: no DDP gradient buffer, no optimizer (fp32 main weights, Adam
moments), no LR schedule. Its offload moves all of it to host memory; its log-probs equal HF
transformers' in float64 and a trained engine's with the same weights; training calls are refused
by name.

What an engine holds is found without asking the engine: every tensor reachable from the engine
object (its attributes, Megatron's DDP and optimizer objects, their lists and dicts), counted once
per storage.
"""

from __future__ import annotations

import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from _launch import run_distributed
from engine_helpers import hf_logprobs, make_batch, make_hf_model, pg_loss_fn, save_hf_model

pytestmark = pytest.mark.distributed

# The one non-parameter tensor a Megatron GPT model keeps: RotaryEmbedding.inv_freq (a plain
# attribute, not a registered buffer; kv_channels / 2 fp32 values: 32 bytes here).
ROPE = "inv_freq"


def held_storages(root: Any) -> dict[tuple[int, int], tuple[int, str]]:
    """Every tensor storage reachable from `root` through attributes, lists, tuples, sets and dicts
    (keys too: Adam's state is keyed by parameter): {key: (bytes, first path found)}."""
    seen: set[int] = set()
    found: dict[tuple[int, int], tuple[int, str]] = {}
    stack: list[tuple[Any, str]] = [(root, "engine")]
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str, bytes, int, float, bool)
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, skip) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            # A freed storage (size 0) has no address of its own: count it per tensor.
            key = (storage.data_ptr(), 0) if storage.size() > 0 else (0, id(obj))
            found.setdefault(key, (storage.nbytes(), path))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                stack.append((v, f"{path}[{k!r}]" if isinstance(k, (str, int)) else f"{path}[<{type(k).__name__}>]"))
                stack.append((k, f"{path}.<key>"))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif isinstance(obj, types.MethodType):
            stack.append((obj.__self__, f"{path}.__self__"))
        elif isinstance(getattr(obj, "__dict__", None), dict):
            stack.extend((v, f"{path}.{k}") for k, v in vars(obj).items())
    return found


def _engine(hf_dir: str, layout: Any = None, **cfg: Any) -> Any:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.models.spec import ModelSpec

    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout or ParallelLayout(),
                            EngineConfig(**{"micro_batch_size": 2, **cfg}))
    engine.load_hf_weights(hf_dir)
    return engine


def _memory(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.errors import EngineStateError
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for dtype in ("bf16", "fp32"):
        for trained in (True, False):
            engine = _engine(hf_dir, dtype=dtype, trained=trained)
            params = list(engine.model.parameters())
            param_ptrs = {p.untyped_storage().data_ptr() for p in params}
            case: dict[str, Any] = {
                "param_bytes": sum(p.numel() * p.element_size() for p in params),
                "requires_grad": any(p.requires_grad for p in params),
            }
            held = held_storages(engine)
            case["held_bytes"] = sum(n for n, _ in held.values())
            case["other"] = {path: n for key, (n, path) in held.items() if key[0] not in param_ptrs}
            if trained:
                out[(dtype, trained)] = case
                continue
            lp_before = engine.compute_log_prob(batch)["log_probs"]
            # What `EngineRole.offload` asks for a role with OffloadSpec(params=True), then the default.
            for kwargs in (dict(params=True, grads=False, optimizer=False), {}):
                engine.offload_to_cpu(**kwargs)
                copies = {cpu.untyped_storage().data_ptr() for _, cpu, _ in engine.offloaded.entries}
                left = {path: n for key, (n, path) in held_storages(engine).items() if key[0] not in copies and n > 0}
                case.setdefault("left_after_offload", []).append(left)
                case.setdefault("offloaded", []).append((engine.offloaded.num_bytes, sorted(engine.offloaded.groups)))
                try:
                    engine.compute_log_prob(batch)
                except EngineStateError as err:
                    case.setdefault("refused", []).append(str(err))
                engine.onload(("params",))
                case.setdefault("onloaded", []).append(engine.offloaded is None)
                case.setdefault("lp_after", []).append(torch.equal(engine.compute_log_prob(batch)["log_probs"], lp_before))
            out[(dtype, trained)] = case
    return out


def test_a_frozen_engine_holds_its_parameters_only_and_offloads_all_of_them() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen2"))
    res = run_distributed(_memory, 1, hf_dir, make_batch(seed=5, batch=4))[0]
    for dtype in ("bf16", "fp32"):
        frozen, trained = res[(dtype, False)], res[(dtype, True)]
        print(f"{dtype}: parameters {frozen['param_bytes']} B; held: trained {trained['held_bytes']} B, "
              f"frozen {frozen['held_bytes']} B")
        # The measure sees a trained engine's gradient buffer (fp32) and, in bf16, its fp32 main weights.
        assert trained["held_bytes"] >= (5 if dtype == "bf16" else 2) * trained["param_bytes"] - 1024, (dtype, trained)
        # Parameters and the 32-byte RoPE frequencies: no gradient buffer, no optimizer tensor.
        assert frozen["held_bytes"] - frozen["param_bytes"] == sum(frozen["other"].values()) <= 64, (dtype, frozen)
        assert set(frozen["other"]) == {p for p in frozen["other"] if p.endswith(ROPE)}, (dtype, frozen["other"])
        assert not frozen["requires_grad"], dtype
        for left, (moved, groups) in zip(frozen["left_after_offload"], frozen["offloaded"]):
            # Offloaded: every parameter storage freed and its bytes in host copies; nothing else.
            assert moved == frozen["param_bytes"] and groups == ["params"], (dtype, moved, groups)
            assert all(path.endswith(ROPE) for path in left), (dtype, left)
        assert len(frozen["refused"]) == 2 and "compute_log_prob while its params are offloaded" in frozen["refused"][0]
        assert all(frozen["onloaded"]) and all(frozen["lp_after"]), dtype


def _log_probs(rank: int, world: int, port: int, dirs: dict, batch: dict, shared: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out: dict[Any, Any] = {}
    for kind, hf_dir in dirs.items():
        for packed in (False, True):
            for trained in (True, False):
                engine = _engine(hf_dir, trained=trained, use_sequence_packing=packed)
                out[(kind, packed, trained)] = engine.compute_log_prob(batch, temperature=1.3, calculate_entropy=True)
    for trained in (True, False):
        engine = _engine(dirs["llama"], dtype="bf16", trained=trained, micro_batch_size=4)
        out[("bf16", trained)] = engine.compute_log_prob(batch, temperature=1.3)["log_probs"]
        # The prompt-sharing hook (one sequence per prompt) on the frozen path as on the trained one.
        engine = _engine(dirs["llama"], trained=trained, micro_batch_size=4, prompt_sharing="always")
        shapes: list[tuple[int, ...]] = []
        engine.model.embedding.register_forward_pre_hook(
            lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
        out[("shared", trained)] = engine.compute_log_prob(shared, temperature=1.3)["log_probs"]
        out[("shared_rows", trained)] = sum(s[0] for s in shapes)
    return out


def test_frozen_log_probs_equal_transformers_and_the_trained_engines() -> None:
    from test_engine_shared_prompts import grouped_batch

    models = {kind: make_hf_model(kind, seed=i) for i, kind in enumerate(("llama", "qwen3"))}
    dirs = {kind: save_hf_model(m) for kind, m in models.items()}
    batch, shared = make_batch(seed=3, batch=5), grouped_batch(seed=4)
    got = run_distributed(_log_probs, 1, dirs, batch, shared)[0]
    mask = batch["response_mask"].bool()
    for kind, model in models.items():
        want_lp, want_ent = hf_logprobs(model, batch, temperature=1.3)
        for packed in (False, True):
            frozen, trained = got[(kind, packed, False)], got[(kind, packed, True)]
            lp_err = (frozen["log_probs"].double() - want_lp)[mask].abs().max().item()
            ent_err = (frozen["entropys"].double() - want_ent)[mask].abs().max().item()
            assert lp_err < 1e-5 and ent_err < 1e-5, (kind, packed, lp_err, ent_err)
            # The forward computation of a trained engine: the reference's log-probs at step 0 are the
            # actor's to float32 rounding. Not bit for bit: torch.matmul folds the output layer's
            # gathered (non-contiguous) input differently when the weight requires a gradient, which
            # moves a few log-probs by an ulp (4.8e-7 measured).
            for key in ("log_probs", "entropys"):
                assert (frozen[key] - trained[key]).abs().max().item() <= 1e-6, (kind, packed, key)
    assert (got[("bf16", False)] - got[("bf16", True)]).abs().max().item() <= 1e-6
    bf16_err = (got[("bf16", False)].double() - hf_logprobs(models["llama"], batch, temperature=1.3)[0])[mask]
    assert 0 < bf16_err.abs().max().item() < 0.5
    want_shared, _ = hf_logprobs(models["llama"], shared, temperature=1.3)
    shared_mask = shared["response_mask"].bool()
    assert (got[("shared", False)].double() - want_shared)[shared_mask].abs().max().item() < 1e-5
    assert (got[("shared", False)] - got[("shared", True)]).abs().max().item() <= 1e-6
    assert got[("shared_rows", False)] == got[("shared_rows", True)] < len(shared["responses"])  # prompts shared


def _parallel(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    out = {}
    for layout_kw in (dict(tp=2), dict(pp=2)):
        layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
        engine = _engine(hf_dir, layout, trained=False)
        out[str(layout_kw)] = engine.compute_log_prob(batch, temperature=1.3)["log_probs"]
        engine.offload_to_cpu()
        engine.onload()
        out[f"{layout_kw} after offload"] = engine.compute_log_prob(batch, temperature=1.3)["log_probs"]
    return out


def test_frozen_engine_at_tp2_and_pp2() -> None:
    model = make_hf_model("qwen2", seed=2)
    batch = make_batch(seed=9, batch=4)
    want, _ = hf_logprobs(model, batch, temperature=1.3)
    mask = batch["response_mask"].bool()
    for rank_out in run_distributed(_parallel, 2, save_hf_model(model), batch):
        for key, lp in rank_out.items():
            assert (lp.double() - want)[mask].abs().max().item() < 1e-5, key


def _training_refused(rank: int, world: int, port: int, hf_dir: str, batch: dict, ckpt_dir: str) -> list:
    from megarl.errors import EngineStateError
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    engine = _engine(hf_dir, trained=False)
    refused = []
    for call in (lambda: engine.train_step(batch, pg_loss_fn, mini_batch_size=4, calculate_entropy=True),
                 lambda: engine.save_checkpoint(ckpt_dir),
                 lambda: engine.load_checkpoint(ckpt_dir),
                 lambda: engine.optimizer.step(),
                 lambda: engine.scheduler.num_steps):
        try:
            call()
            refused.append(None)
        except EngineStateError as err:
            refused.append(str(err))
    refused.append(getattr(engine.optimizer, "chained_optimizers", "absent"))  # generic code sees no attribute
    engine.optimizer.reload_model_params()  # after a weight load (megarl.convert.engine_load): nothing to do
    return refused


def test_training_calls_on_a_frozen_engine_are_refused_by_name(tmp_path) -> None:
    hf_dir = save_hf_model(make_hf_model("llama"))
    refused = run_distributed(_training_refused, 1, hf_dir, make_batch(seed=1, batch=4), str(tmp_path / "ckpt"))[0]
    assert refused[-1] == "absent"
    for call, err in zip(("train_step", "save_checkpoint", "load_checkpoint", "'step'", "'num_steps'"), refused):
        assert err is not None and "frozen" in err and call in err, (call, err)
    assert not (tmp_path / "ckpt").exists()


# ---------------------------------------------------------------- the reference role, from the config
def _ref_role(rank: int, world: int, port: int, spec: Any, batch: dict) -> dict:
    from megarl.megatron.parallel import init_distributed
    from megarl.workers.roles import RefRole

    init_distributed(rank, world, "127.0.0.1", port, spec.layout)
    role = RefRole(SimpleNamespace(rank=rank), spec)
    role.init_model()  # offloaded at the end of it (ref.param_offload)
    engine = role.engine
    out = {"trained": getattr(engine, "trained", None), "offloaded_at_start": engine.offloaded is not None}
    copies = {cpu.untyped_storage().data_ptr() for _, cpu, _ in engine.offloaded.entries}
    out["left_offloaded"] = {p: n for k, (n, p) in held_storages(engine).items() if k[0] not in copies and n > 0}
    micro: list[list[int]] = []
    run = engine._run

    def observed(mbs: list, *args: Any, **kwargs: Any) -> Any:
        micro.extend([mb["rows"].total_lens.tolist() for mb in mbs])
        return run(mbs, *args, **kwargs)

    engine._run = observed
    role.onload(params_only=True)  # what the trainer's phase "ref" does around the call
    out["ref_log_prob"] = role.compute_ref_log_prob(batch)["ref_log_prob"]
    role.offload()
    out["micro"] = micro
    out["offloaded_at_end"] = engine.offloaded is not None
    return out


REF_CONFIG = {
    "data": {"train_files": ["train.parquet"], "train_batch_size": 8, "max_prompt_length": 6, "max_response_length": 5},
    "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2, "use_kl_loss": True},
    "rollout": {"n": 4},
    "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 1}},
}


def test_reference_role_follows_the_actors_dynamic_batching_on_the_frozen_path(tmp_path) -> None:
    """The reference spec the trainer resolves (ref.param_offload, actor.use_dynamic_bsz with a
    24-token budget) builds a frozen engine, starts offloaded, splits its log-prob pass by tokens as
    the actor's passes do, and computes HF's log-probs."""
    from megarl.config import load_config
    from megarl.megatron.packing import plan_micro_batches
    from megarl.trainer.run_spec import resolve_run_spec

    model = make_hf_model("qwen2", seed=4)
    hf_dir = save_hf_model(model)
    config = {**REF_CONFIG, "model": {"hf_config": dict(model.config.to_diff_dict(), model_type="qwen2")}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    budget = 24
    # (REF_CONFIG's actor micro-batch of 2 sequences, unread by tokens, back to its default.)
    cfg = load_config(path, ["actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={budget}",
                             "actor.ppo_micro_batch_size_per_gpu=4", "ref.param_offload=true",
                             "ref.log_prob_micro_batch_size_per_gpu=8", "rollout.temperature=1.0"])
    spec = resolve_run_spec(cfg, hf_dir, pad_token_id=0, eos_token_ids=[1], total_steps=2).ref
    batch = make_batch(seed=2, batch=6)
    res = run_distributed(_ref_role, 1, spec, batch)[0]
    lengths = batch["attention_mask"].sum(1)
    # Split by the actor's token budget (rows x longest row, padded), not into one micro-batch of 8 rows.
    want = [lengths[idx].tolist() for idx in plan_micro_batches(lengths, max_tokens=budget)]
    assert len(res["micro"]) > 1 and res["micro"] == want, res["micro"]
    assert all(len(mb) * max(mb) <= budget for mb in res["micro"]), res["micro"]
    assert res["trained"] is False and res["offloaded_at_start"] and res["offloaded_at_end"]
    assert all(p.endswith(ROPE) for p in res["left_offloaded"]), res["left_offloaded"]
    want_lp, _ = hf_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    assert (res["ref_log_prob"].double() - want_lp)[mask].abs().max().item() < 1e-5
