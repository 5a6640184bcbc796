"""`LocalMLP` inside Megatron's tensor-parallel linear layers at TP=2 (gloo) against Megatron's own
`MLP` with the same weights: the same output, input gradient and weight gradients, bit for bit, in
fp32 and bf16; configs `swiglu` does not compute (a GLU offset) take Megatron's path. And the model
chunks the engines build on the local spec use it, and `LocalRMSNorm` for every norm."""

from __future__ import annotations

import pytest
import torch

from _launch import run_distributed

pytestmark = pytest.mark.distributed


def _graph_nodes(y: torch.Tensor) -> set[str]:
    names, stack = set(), [y.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None:
            names.add(type(fn).__name__)
            stack.extend(f for f, _ in fn.next_functions)
    return names


def _compare(rank: int, world: int, port: int) -> list[dict]:
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.layout import ParallelLayout
    from engine_helpers import make_hf_model
    from megarl.megatron.mlp import LocalMLP, swiglu_applies, use_local_mlps
    from megarl.megatron.model import build_model_chunk
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(tp=2))
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    out = []
    for dtype, offset in ((torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.float32, 0.5)):
        config = TransformerConfig(
            num_layers=1, hidden_size=16, ffn_hidden_size=24, num_attention_heads=2, gated_linear_unit=True,
            activation_func=F.silu, glu_linear_offset=offset, add_bias_linear=False, bias_activation_fusion=False,
            use_cpu_initialization=True, tensor_model_parallel_size=2, params_dtype=dtype,
            bf16=dtype == torch.bfloat16, pipeline_dtype=dtype)
        torch.manual_seed(0)
        reference = MLP(config, submodules)
        local = MLP(config, submodules)
        assert use_local_mlps(local) == 1 and type(local) is LocalMLP
        local.load_state_dict(reference.state_dict())
        g = torch.Generator().manual_seed(1)  # the same input and output gradient on both ranks
        x = torch.randn(7, 3, 16, generator=g).to(dtype)
        grad = torch.randn(7, 3, 16, generator=g).to(dtype)
        result = {"dtype": str(dtype), "offset": offset, "swiglu": swiglu_applies(config)}
        for name, module in (("reference", reference), ("local", local)):
            inp = x.clone().requires_grad_()
            y, bias = module(inp)
            result[f"{name}_nodes"] = _graph_nodes(y)
            y.backward(grad)
            result[name] = {"y": y.detach(), "bias": bias, "dx": inp.grad,
                            **{p: t.grad.clone() for p, t in module.named_parameters()}}
        out.append(result)
    # What the engines build on the local spec: every layer's MLP is a LocalMLP.
    chunk = build_model_chunk(ModelSpec.from_hf_config(make_hf_model("qwen2").config), "policy",
                              torch.float32, tp=2, pp=1, use_te=False)
    out.append({"chunk_mlps": [type(layer.mlp).__name__ for layer in chunk.decoder.layers],
                "chunk_norms": sorted({type(m).__name__ for m in chunk.modules() if "Norm" in type(m).__name__})})
    return out


def test_local_mlp_matches_megatrons_mlp_bit_for_bit_at_tp2() -> None:
    results = run_distributed(_compare, 2)
    for rank, cases in enumerate(results):
        chunk = cases.pop()
        assert chunk["chunk_mlps"] == ["LocalMLP", "LocalMLP"]
        assert chunk["chunk_norms"] == ["LocalRMSNorm"]
        assert [c["swiglu"] for c in cases] == [True, True, False]
        for case in cases:
            # The swiglu cases ran swiglu, and only they did.
            assert ("_SwiGLUBackward" in case["local_nodes"]) == case["swiglu"]
            assert "_SwiGLUBackward" not in case["reference_nodes"]
            ref, local = case["reference"], case["local"]
            assert set(ref) == set(local) == {"y", "bias", "dx", "linear_fc1.weight", "linear_fc2.weight"}
            assert local["bias"] is None and ref["bias"] is None
            for key in ("y", "dx", "linear_fc1.weight", "linear_fc2.weight"):
                assert torch.equal(local[key], ref[key]), (rank, case["dtype"], case["offset"], key)
            assert float(local["dx"].abs().sum()) > 0 and float(local["linear_fc1.weight"].abs().sum()) > 0
