"""Engine settings, Megatron optimizer (distributed Adam) and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.dtypes import ALIASES, torch_dtype
from megarl.errors import ConfigError

LR_SCHEDULES = ("constant", "cosine", "linear")
# Training dtypes (megarl.dtypes names; fp16 is refused in `validate`).
TRAIN_DTYPES = ("fp32", "bf16")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
PROMPT_SHARING = ("auto", "always", "never")


@dataclass
class EngineConfig:
    """What a training engine needs besides the model spec and the parallel layout."""

    role: str = "policy"  # policy | value | reward
    # False: a frozen role (reference policy, reward model), forward passes only: the engine builds
    # no DDP wrapper (gradient buffer), optimizer (fp32 main weights) or LR schedule, and its
    # parameters need no gradient. The optimizer settings below then shape nothing.
    trained: bool = True
    dtype: str = "fp32"  # fp32 | bf16
    seed: int = 1
    lr: float = 1e-6
    min_lr: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    # After a linear warmup from 0: constant `lr`, or cosine / linear decay from `lr` to `min_lr`
    # over `total_training_steps` (Megatron's lr_decay_style).
    lr_schedule: str = "constant"  # constant | cosine | linear
    lr_warmup_steps: int = 0
    total_training_steps: int = 1  # optimizer steps, for the decay
    micro_batch_size: int = 4  # rows per micro-batch of train_step
    # Rows per micro-batch of the forward-only calls (compute_log_prob, compute_values,
    # compute_rm_score); 0: micro_batch_size. With use_dynamic_bsz the token budget decides instead.
    log_prob_micro_batch_size: int = 0
    use_dynamic_bsz: bool = False
    max_token_len_per_micro_batch: int = 4096
    # Concatenate the rows of a micro-batch into one row (no padding tokens at all): a
    # block-diagonal causal mask with the local spec, THD cu_seqlens with TransformerEngine.
    use_sequence_packing: bool = False
    # Rows of a micro-batch that share a prompt become one sequence, the prompt computed once
    # (`megarl.megatron.shared_prompts`): "auto" when it costs fewer multiply-adds than the padded
    # micro-batch, "always" whenever a prompt is shared, "never". Local layer spec, no context or
    # pipeline parallelism, no sequence parallelism; policy and value roles (elsewhere: "never").
    prompt_sharing: str = "never"
    use_distributed_optimizer: bool = True
    # Megatron sequence parallelism: outside the TP regions (norms, dropout, residuals) activations
    # are split along the sequence over the TP ranks. Needs tensor parallel size > 1.
    sequence_parallel: bool = False
    # Activation recompute in the backward pass (Megatron's names): None; "full" recomputes every
    # transformer layer from its input (recompute_method="uniform", recompute_num_layers=1);
    # "selective" recomputes only the core attention (recompute_modules=["core_attn"]).
    recompute_granularity: str | None = None
    # CPU plain DDP: sum the data-parallel gradients through shared memory when every rank of the
    # group runs on this host (`megarl.megatron.host_reduce`), else with gloo.
    host_grad_reduce: bool = False

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        self.validate()

    def validate(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"engine config: lr_schedule={self.lr_schedule!r}, valid: {LR_SCHEDULES}")
        if self.dtype in ("fp16", "float16", "half"):
            raise ConfigError(
                f"engine config: dtype={self.dtype!r} is not supported: fp16 training needs loss scaling, "
                f"which this engine does not run; use 'bf16' (same memory, no loss scaling) or 'fp32'"
            )
        if self.dtype not in TRAIN_DTYPES and ALIASES.get(self.dtype) not in TRAIN_DTYPES:
            raise ConfigError(f"engine config: dtype={self.dtype!r}, valid: {TRAIN_DTYPES}")
        if self.prompt_sharing not in PROMPT_SHARING:
            raise ConfigError(f"engine config: prompt_sharing={self.prompt_sharing!r}, valid: {PROMPT_SHARING}")
        if self.micro_batch_size < 1:
            raise ConfigError(f"engine config: micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.log_prob_micro_batch_size < 0:
            raise ConfigError(f"engine config: log_prob_micro_batch_size={self.log_prob_micro_batch_size} "
                              "must be >= 1, or 0 for micro_batch_size")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ConfigError(f"engine config: recompute_granularity={self.recompute_granularity!r}, "
                              f"valid: {RECOMPUTE_GRANULARITIES}")
        if self.host_grad_reduce and not self.trained:
            raise ConfigError("engine config: host_grad_reduce=True with trained=False: a frozen engine sums no "
                              "gradients")
        if self.lr_warmup_steps < 0 or self.total_training_steps < 1:
            raise ConfigError("engine config: lr_warmup_steps >= 0 and total_training_steps >= 1 required")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def forward_micro_batch_size(self) -> int:
        """Rows per micro-batch of forward-only calls."""
        return self.log_prob_micro_batch_size or self.micro_batch_size


def build_optimizer(cfg: EngineConfig, model_chunks: list[torch.nn.Module]) -> Any:
    """Megatron's (distributed) Adam over the DDP-wrapped chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        clip_grad=cfg.clip_grad,
        bf16=cfg.torch_dtype == torch.bfloat16,
        params_dtype=cfg.torch_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model_chunks)
    fuse_host_adam(optimizer)
    use_foreach_multi_tensor_ops()
    return optimizer


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                    per_tensor: bool, *args: Any) -> tuple[torch.Tensor, None]:
    """Megatron's `local_multi_tensor_l2_norm` (the L2 norm of all tensors together, as a 1-element
    tensor) with one `torch._foreach_norm` instead of a `torch.norm` call per tensor."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                  scale: Any) -> None:
    """Megatron's `local_multi_tensor_scale` (dst = src * scale for each pair) as foreach kernels."""
    src, dst = tensor_lists
    if not dst:
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_multi_tensor_ops() -> None:
    """Where neither apex nor TransformerEngine is installed, Megatron clips gradients and copies
    fp32 main parameters with Python loops of one op per tensor (`megatron.core.utils.local_multi_
    tensor_*`). Swap in the foreach equivalents above: the same values (the scale bit for bit, the
    norm to fp32 rounding) in a few kernels. Clipping the quickstart model's 51 gradients (norm, then
    scale) on one CPU thread: 2.2-2.6 ms with Megatron's loops, 0.9-1.0 ms with these. Fused apex/TE
    kernels, where present, are left in place."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if getattr(clip_grads, "l2_norm_impl", None) is mcore_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, mcore_optimizer):
        if getattr(module, "multi_tensor_scale_impl", None) is mcore_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def fuse_host_adam(optimizer: Any) -> None:
    """Switch torch's Adam/AdamW inside a Megatron optimizer to its fused kernel where every
    parameter it steps is in host memory.

    Without apex or TransformerEngine Megatron steps with `torch.optim.AdamW`, which on CPU runs
    its update one parameter and one elementwise op at a time (`foreach` is a CUDA default only).
    The fused CPU kernel computes the same update in one pass per tensor: 8.7 -> 1.5 ms a step
    for the quickstart model's 2.4M parameters on one core, the same largest difference from a
    float64 AdamW after 10 steps (3.0e-6). GPU parameters keep whatever Megatron chose.
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):  # apex / TE fused Adam: already fused
            continue
        if any(p.device.type != "cpu" for group in inner.param_groups for p in group["params"]):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        inner.defaults["fused"], inner.defaults["foreach"] = True, False


def build_scheduler(cfg: EngineConfig, optimizer: Any) -> Any:
    """Linear warmup from 0 to `lr` over `lr_warmup_steps`, then constant, or cosine or linear decay
    to `min_lr` at step `total_training_steps` (`min_lr` after it).

    On a resume only the step count comes from the checkpoint: the schedule is this config's
    (`override_opt_param_scheduler`; Megatron's default takes max/min LR, warmup, decay steps and
    style from the checkpoint, so a run extended by raising total_training_steps would go on at the
    old schedule's end, min_lr, and a changed lr would be ignored). `checkpoint.load` warns about
    each setting that differs from the checkpoint's."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = cfg.lr_warmup_steps
    decay_steps = max(cfg.total_training_steps, warmup + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.lr if cfg.lr_schedule == "constant" else cfg.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=cfg.lr_schedule,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
