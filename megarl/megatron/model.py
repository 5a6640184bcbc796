"""Build this rank's model chunk: a GPTModel policy, or the same trunk with a scalar head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megarl.errors import CheckpointError, ConfigError
from megarl.models.spec import ModelSpec, te_available

ROLES = ("policy", "value", "reward")


class ScalarHead(nn.Module):
    """hidden (s, b, h) -> (s, b, 1). Stands where GPTModel's output layer is; replicated over TP
    (its input is identical on every TP rank, so are its gradients)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: Any = None) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden, self.weight), None


def build_model_chunk(spec: ModelSpec, role: str, params_dtype: torch.dtype, tp: int, pp: int,
                      use_te: bool | None = None, cp: int = 1, ep: int = 1) -> nn.Module:
    """The GPTModel (or value/reward model) for this rank's pipeline stage, unwrapped.

    At cp > 1 the sequence axis is split over the context-parallel group (see `context_parallel`):
    TransformerEngine's attention handles CP itself; on the local spec (CPU, or GPU without TE) the
    core attention is replaced by `ContextParallelAttention`, which Megatron's DotProductAttention
    (it asserts cp == 1) cannot do.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if role not in ROLES:
        raise ConfigError(f"engine role={role!r}, valid: {ROLES}")
    scalar = role != "policy"
    if use_te is None:
        use_te = te_available()
    config = spec.transformer_config(tp=tp, pp=pp, cp=cp, ep=ep, params_dtype=params_dtype)
    layer_spec = spec.layer_spec(use_te)
    if cp > 1 and not use_te:
        from megarl.megatron.context_parallel import with_context_parallel_attention

        layer_spec = with_context_parallel_attention(layer_spec)
    # With TE, TEDotProductAttention runs CP on the same split (chunks r and 2*cp-1-r, THD per
    # sequence when packed) with config.cp_comm_type; that path needs CUDA and is not run on CPU.
    post = ps.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings and not scalar,
        position_embedding_type="rope",
        rotary_base=int(spec.rotary_base) if float(spec.rotary_base).is_integer() else spec.rotary_base,
    )
    if scalar and post:
        model.output_layer = ScalarHead(config.hidden_size, params_dtype)
    return model


def wrap_for_training(model: nn.Module, use_distributed_optimizer: bool = True) -> nn.Module:
    """Float16Module (bf16/fp16 only) then Megatron DDP with fp32 gradient buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = model.config
    if config.bf16 or config.fp16:
        # Without it the distributed optimizer maps its fp32 main params to the wrong model params.
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def load_megatron_state(model: nn.Module, state: dict[str, torch.Tensor], role: str,
                        optional: tuple[str, ...] = ()) -> None:
    """Copy tensors into the unwrapped model's parameters in place (shapes must match)."""
    params = dict(unwrap(model).named_parameters())
    missing = [n for n in params if n not in state and n not in optional]
    if missing:
        raise CheckpointError(f"{role} model: no weights for {missing[:5]}")
    unknown = [n for n in state if n not in params]
    if unknown:
        raise CheckpointError(f"{role} model: weights for unknown parameters {unknown[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            p = params[name]
            if tuple(p.shape) != tuple(tensor.shape):
                raise CheckpointError(f"{name}: model shape {tuple(p.shape)}, weights {tuple(tensor.shape)}")
            p.copy_(tensor.to(p.dtype))
