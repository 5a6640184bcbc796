"""Build this rank's model chunk: a GPTModel policy, or the same trunk with a scalar head."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from torch import nn

from megarl.errors import CheckpointError, ConfigError
from megarl.megatron.attention import with_local_attention
from megarl.megatron.mlp import use_local_mlps
from megarl.megatron.norm import LocalRMSNorm
from megarl.megatron.spec_rewrite import replace_modules
from megarl.models.spec import ModelSpec, te_available

ROLES = ("policy", "value", "reward")


class ScalarHead(nn.Module):
    """hidden (s, b, h) -> (s, b, 1). Stands where GPTModel's output layer is; replicated over TP.

    Without sequence parallelism its input is identical on every TP rank, so are its gradients.
    With it, each TP rank holds s/tp positions of the hidden states: the head maps its own positions
    and all-gathers the (s, b, 1) result (backward: each rank keeps its slice of the gradient, which
    is the same on every rank because every rank computes the same loss). Each rank's weight gradient
    then covers its positions only; the weight is marked `sequence_parallel`, so Megatron's
    finalize_model_grads sums it over the TP group."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)
        self.sequence_parallel = sequence_parallel
        self.weight.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: Any = None) -> tuple[torch.Tensor, None]:
        out = torch.nn.functional.linear(hidden, self.weight)
        if self.sequence_parallel:
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out, None


class LocalNorm:
    """The local layer spec's norm: torch's RMSNorm (`norm.LocalRMSNorm`, a backward pass of its own)
    or LayerNorm, like Megatron's `WrappedTorchNorm` (same parameter names), which refuses sequence
    parallelism. Under sequence parallelism a norm sees this TP rank's positions only, so its
    parameters are marked `sequence_parallel` and finalize_model_grads sums their gradients over the
    TP group (as TransformerEngine's norms do). Q/K norms are summed over TP anyway (each rank
    normalises its own heads); the mark does not sum them twice."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> nn.Module:
        kinds = {"LayerNorm": nn.LayerNorm, "RMSNorm": LocalRMSNorm}
        if config.normalization not in kinds:
            raise ConfigError(f"normalization={config.normalization!r} on the local layer spec; valid: {sorted(kinds)}")
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ConfigError("the local layer spec's torch norms support neither zero-centred gamma "
                              "nor memory-efficient layer norm")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def with_local_norms(layer_spec: Any, config: Any) -> Any:
    """The local layer spec with `LocalNorm` for every `WrappedTorchNorm`, as block submodules whose
    final norm is `LocalNorm` too (GPTModel otherwise builds the final norm from Megatron's
    module-level default). Raises ConfigError if the spec has no torch norm to replace."""
    spec, replaced = replace_modules(layer_spec, lambda node: node is WrappedTorchNorm, LocalNorm)
    if not replaced:
        raise ConfigError("the local layer spec has no torch norm (WrappedTorchNorm) to replace")
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=LocalNorm)


def build_model_chunk(spec: ModelSpec, role: str, params_dtype: torch.dtype, tp: int, pp: int,
                      use_te: bool | None = None, cp: int = 1, ep: int = 1, sequence_parallel: bool = False,
                      recompute_granularity: str | None = None, etp: int | None = None) -> nn.Module:
    """The GPTModel (or value/reward model) for this rank's pipeline stage, unwrapped.

    At cp > 1 the sequence axis is split over the context-parallel group (see `context_parallel`);
    TransformerEngine's attention handles CP itself. On the local spec (CPU, or GPU without TE) the
    core attention is `attention.LocalAttention` (torch's fused attention kernel, any cp) in place of
    Megatron's DotProductAttention, the norms are `LocalNorm` (sequence parallel capable) and the
    MLPs are `mlp.LocalMLP` (SwiGLU as one autograd node).
    `sequence_parallel`, `recompute_granularity` and `etp` (expert tensor parallel size, None: tp):
    see `ModelSpec.transformer_config`.
    """
    if role not in ROLES:
        raise ConfigError(f"engine role={role!r}, valid: {ROLES}")
    scalar = role != "policy"
    if use_te is None:
        use_te = te_available()
    config = spec.transformer_config(tp=tp, pp=pp, cp=cp, ep=ep, params_dtype=params_dtype,
                                     sequence_parallel=sequence_parallel,
                                     recompute_granularity=recompute_granularity, etp=etp)
    layer_spec = spec.layer_spec(use_te)
    if not use_te:
        layer_spec = with_local_norms(with_local_attention(layer_spec, config), config)
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
    if spec.rope_scaling is not None:
        # Llama 3.x RoPE scaling with the HF config's own constants, set before the first forward
        # (RotaryEmbedding caches its output per length). GPTModel's rope_scaling would fix three of
        # them (see ModelSpec.scaled_inv_freq).
        model.rotary_pos_emb.inv_freq = spec.scaled_inv_freq(model.rotary_pos_emb.inv_freq)
    if not use_te:
        use_local_mlps(model)
    if scalar and post:
        model.output_layer = ScalarHead(config.hidden_size, params_dtype, config.sequence_parallel)
    if torch.cuda.is_available():
        # Megatron creates its own layers on the current device, but the local spec's torch norms and
        # the scalar head start in host memory (Megatron's get_model moves the whole model the same
        # way). The distributed optimizer's parameter buffer used to hide this; plain DDP does not.
        model.cuda(torch.cuda.current_device())
    return model


def wrap_for_training(model: nn.Module, use_distributed_optimizer: bool = True) -> nn.Module:
    """Float16Module (bf16/fp16 only) then Megatron DDP with fp32 gradient buffers."""
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
