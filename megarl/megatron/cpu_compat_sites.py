"""Every CUDA reference in the Megatron-Core files on megarl's training path, and how it is covered.

`scan_cuda_sites()` lists (file, stripped line) for each `torch.cuda.`, `"cuda"`, `.cuda(` or CUDA
tensor-type name. A site is covered when:
- its module is proxied (`cpu_compat.PROXIED_MODULES`) and it calls a `torch.cuda` attribute the
  CPU stand-in implements, or passes `device="cuda"` to a tensor factory on the same line; or
- it is listed in `EXPLICIT_SITES` with the reason it is safe.
A unit test fails on any site that is neither: a megatron-core upgrade that adds a CUDA call on
this path must be looked at, not met at run time.
"""

from __future__ import annotations

import re
from pathlib import Path

SCANNED_FILES: tuple[str, ...] = (
    "tensor_parallel/random.py", "tensor_parallel/layers.py", "tensor_parallel/mappings.py",
    "tensor_parallel/utils.py", "models/common/embeddings/rotary_pos_embedding.py",
    "models/common/embeddings/rope_utils.py", "models/common/language_module/language_module.py",
    "models/common/embeddings/language_model_embedding.py",
    "models/gpt/gpt_model.py", "transformer/module.py", "transformer/utils.py",
    "transformer/dot_product_attention.py", "transformer/attention.py", "transformer/mlp.py",
    "transformer/transformer_layer.py", "transformer/transformer_block.py", "utils.py",
    "parallel_state.py", "distributed/param_and_grad_buffer.py",
    "distributed/distributed_data_parallel.py", "distributed/finalize_model_grads.py",
    "pipeline_parallel/schedules.py", "pipeline_parallel/p2p_communication.py",
    "optimizer/optimizer.py", "optimizer/distrib_optimizer.py", "optimizer/clip_grads.py",
    "optimizer/grad_scaler.py", "dist_checkpointing/serialization.py",
    "dist_checkpointing/strategies/torch.py", "dist_checkpointing/strategies/filesystem_async.py",
    "dist_checkpointing/strategies/state_dict_saver.py",
    "transformer/moe/moe_layer.py", "transformer/moe/moe_utils.py", "transformer/moe/router.py",
    "transformer/moe/token_dispatcher.py", "transformer/moe/experts.py",
    "transformer/moe/shared_experts.py",
)

_SITE = re.compile(r"torch\.cuda\.|[\"']cuda[\"']|\.cuda\(|cuda\.\w+Tensor")
_CUDA_ATTR = re.compile(r"torch\.cuda\.(\w+)")
_FACTORY_ON_CUDA = re.compile(
    r"torch\.(zeros|ones|empty|tensor|full|arange|empty_like|zeros_like)\(.*device=[\"']cuda[\"']"
)

_TENSOR_METHODS = "runs with CPU-friendly tensor.type()/tensor.cuda() (cpu_compat.TENSOR_METHOD_FUNCTIONS)"
_ERROR_TEXT = "text of an error message"
_DOC = "docstring or comment"

EXPLICIT_SITES: dict[tuple[str, str], str] = {
    ("transformer/moe/token_dispatcher.py",
     'self.permute_idx_device = torch.device("cuda") if self.config.moe_permute_fusion else "cpu"'):
        "moe_permute_fusion is a TransformerEngine kernel; megarl's specs turn it off without TE",
    ("tensor_parallel/random.py", 'device: Union[int, str, torch.device] = "cuda", clone: bool = False, graph_safe: bool = False'):
        "default argument of _get_cuda_rng_state, which cpu_compat replaces",
    ("tensor_parallel/random.py", "This function is adapted from torch.cuda.random.get_rng_state()\"\"\""): _DOC,
    ("tensor_parallel/random.py", "This function is adapted from PyTorch repo (torch.cuda.set_rng_state)"): _DOC,
    ("tensor_parallel/random.py", "device = torch.device(\"cuda\", device)"): "inside _get_cuda_rng_state (replaced)",
    ("tensor_parallel/random.py", "device = torch.device('cuda')"): "inside _set_cuda_rng_state (replaced)",
    ("tensor_parallel/random.py", "device = torch.device('cuda', device)"): "inside _set_cuda_rng_state (replaced)",
    ("tensor_parallel/random.py", "initialized. Also, no torch.cuda.manual_seed should be called"): _DOC,
    ("tensor_parallel/random.py", "1) torch.cuda.set_rng_state is replaced with `_set_cuda_rng_state`"): _DOC,
    ("tensor_parallel/layers.py", 'custom_fwd = partial(torch.amp.custom_fwd, device_type="cuda")'):
        "import-time decorator for autocast; no autocast on CPU",
    ("tensor_parallel/layers.py", 'custom_bwd = partial(torch.amp.custom_bwd, device_type="cuda")'):
        "import-time decorator for autocast; no autocast on CPU",
    ("models/common/embeddings/rope_utils.py", ").cuda(non_blocking=True)"): _TENSOR_METHODS,
    ("models/common/language_module/language_module.py", "weight.data = weight.data.cuda()"): _TENSOR_METHODS,
    ("transformer/module.py", "_FLOAT_TYPES = (torch.FloatTensor, torch.cuda.FloatTensor)"):
        "import-time tuple of legacy type objects, which exist on CPU builds",
    ("transformer/module.py", "_HALF_TYPES = (torch.HalfTensor, torch.cuda.HalfTensor)"):
        "import-time tuple of legacy type objects, which exist on CPU builds",
    ("transformer/module.py", "_BF16_TYPES = (torch.BFloat16Tensor, torch.cuda.BFloat16Tensor)"):
        "import-time tuple of legacy type objects, which exist on CPU builds",
    ("transformer/module.py", "device=torch.cuda.current_device(),"):
        "CUDA-graph warm-up buffers (cuda_graph_impl stays 'none' on CPU)",
    ("transformer/mlp.py", "except (RuntimeError, torch.cuda.OutOfMemoryError) as e:"):
        "exception class, exists on CPU builds",
    ("transformer/mlp.py", "torch.cuda.empty_cache()"): "inside the OutOfMemoryError handler of the sharded-state helper",
    ("parallel_state.py", "torch.cuda.synchronize()"): "NCCL barriers and SHARP set-up only",
    ("parallel_state.py", "device_ids=[torch.cuda.current_device()],"): "NCCL barriers only",
    ("distributed/param_and_grad_buffer.py", "stream_context = torch.cuda.stream(self.communication_stream)"):
        "only with several distributed-optimizer instances (megarl uses one)",
    ("distributed/param_and_grad_buffer.py", "self.communication_stream.wait_stream(torch.cuda.default_stream())"):
        "only with several distributed-optimizer instances",
    ("distributed/param_and_grad_buffer.py", "torch.cuda.default_stream().wait_stream(self.communication_stream)"):
        "only with several distributed-optimizer instances",
    ("distributed/param_and_grad_buffer.py", 'tmp_warmup_tensor = torch.zeros([1], device="cuda")'):
        "NCCL user-buffer registration (nccl_ub) only",
    ("distributed/distributed_data_parallel.py", "communication_stream = torch.cuda.Stream(device=torch.cuda.current_device())"):
        "only with several distributed-optimizer instances",
    ("distributed/distributed_data_parallel.py", "synchronize: Whether to call torch.cuda.synchronize() before freeing."): _DOC,
    ("distributed/distributed_data_parallel.py", "empty_cache: Whether to call torch.cuda.empty_cache() after freeing."): _DOC,
    ("distributed/distributed_data_parallel.py", "synchronize: Whether to call torch.cuda.synchronize() after allocation."): _DOC,
    ("distributed/distributed_data_parallel.py", "torch.cuda.synchronize()"):
        "Megatron's own buffer offload helpers; megarl.megatron.offload is used instead",
    ("distributed/distributed_data_parallel.py", "torch.cuda.empty_cache()"):
        "Megatron's own buffer offload helpers; megarl.megatron.offload is used instead",
    ("pipeline_parallel/schedules.py", 'context_manager = torch.autocast("cuda", dtype=config.autocast_dtype)'):
        "only with config.enable_autocast, which megarl leaves off",
    ("optimizer/optimizer.py", "p.data = p.data.cuda()"): "optimizer CPU-offload (optimizer_cpu_offload) only",
    ("optimizer/optimizer.py", "state_dict[k] = v.cuda()"): "optimizer CPU-offload (optimizer_cpu_offload) only",
    ("optimizer/optimizer.py", "if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:"): _TENSOR_METHODS,
    ("optimizer/optimizer.py", "elif param.type() == 'torch.cuda.FloatTensor':"): _TENSOR_METHODS,
    ("optimizer/optimizer.py", "'torch.cuda.FloatTensor,  '"): _ERROR_TEXT,
    ("optimizer/optimizer.py", "'torch.cuda.HalfTensor, or '"): _ERROR_TEXT,
    ("optimizer/optimizer.py", "'torch.cuda.BFloat16Tensor. '"): _ERROR_TEXT,
    ("optimizer/distrib_optimizer.py", "if model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:"): _TENSOR_METHODS,
    ("optimizer/distrib_optimizer.py", "elif model_param.type() == 'torch.cuda.FloatTensor':"): _TENSOR_METHODS,
    ("optimizer/distrib_optimizer.py", "'torch.cuda.FloatTensor,  '"): _ERROR_TEXT,
    ("optimizer/distrib_optimizer.py", "'torch.cuda.HalfTensor, or '"): _ERROR_TEXT,
    ("optimizer/distrib_optimizer.py", "'torch.cuda.BFloat16Tensor. '"): _ERROR_TEXT,
    ("optimizer/distrib_optimizer.py", "if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:"): _TENSOR_METHODS,
    ("optimizer/distrib_optimizer.py", "send_tensor = send_tensor.cuda()"):
        "non-mem-efficient fully-reshardable gather; megarl sets distrib_optim_fully_reshardable_mem_efficient",
    ("optimizer/clip_grads.py", "assert param.grad.type() == 'torch.cuda.FloatTensor'"): _TENSOR_METHODS,
    ("optimizer/grad_scaler.py", "self._scale = state_dict['scale'].cuda(torch.cuda.current_device())"):
        "fp16 loss scaling only (megarl trains in fp32 or bf16)",
    ("tensor_parallel/random.py", "default_generator = torch.cuda.default_generators[idx]"):
        "inside the replaced RNG helpers and the CUDA-graph-safe RNG path (off on CPU)",
    ("tensor_parallel/random.py", 'hasattr(torch.cuda.CUDAGraph, "register_generator_state")'):
        "CUDA-graph-safe RNG tracker only (use_cudagraphable_rng stays False)",
    ("tensor_parallel/layers.py", "custom_fwd = torch.cuda.amp.custom_fwd"): "import-time branch for torch < 2.4",
    ("tensor_parallel/layers.py", "custom_bwd = torch.cuda.amp.custom_bwd"): "import-time branch for torch < 2.4",
    ("utils.py", "self.symm_buffer = symm_mem.empty(numel, dtype=torch.uint8, device='cuda')"):
        "NCCL symmetric-memory buffer (GPU inference) only",
    ("utils.py", "local_param_hashes = torch.stack(local_param_hashes).cuda()"):
        "check_param_hashes_across_dp_replicas debugging helper, not called by megarl",
    ("utils.py", "self.evt_q.put(torch.cuda.Event(enable_timing=True))"): "StragglerDetector, disabled unless configured",
    ("utils.py", "sev = torch.cuda.Event(enable_timing=True)"): "StragglerDetector, disabled unless configured",
    ("utils.py", "eev = torch.cuda.Event(enable_timing=True)"): "StragglerDetector, disabled unless configured",
    ("utils.py", "temp = torch.cuda.temperature()"): "StragglerDetector, disabled unless configured",
    ("utils.py", "power = torch.cuda.power_draw()"): "StragglerDetector, disabled unless configured",
    ("utils.py", "util = torch.cuda.utilization()"): "StragglerDetector, disabled unless configured",
    ("utils.py", "clock = torch.cuda.clock_rate()"): "StragglerDetector, disabled unless configured",
    ("utils.py", "torch.cuda.nvtx.range_push(msg)"): "NVTX ranges, only when profiling is switched on",
    ("utils.py", "torch.cuda.nvtx.range_pop()"): "NVTX ranges, only when profiling is switched on",
    ("utils.py", "start_gemm_ev (list[torch.cuda.Event]): cuda start event"): _DOC,
    ("utils.py", "stop_gemm_ev (list[torch.cuda.Event]): cuda stop event"): _DOC,
    ("utils.py", "start_data_ev (list[torch.cuda.Event]): cuda start event"): _DOC,
    ("utils.py", "stop_data_ev (list[torch.cuda.Event]): cuda stop event"): _DOC,
    ("utils.py", "self.start_gemm_ev: List[torch.cuda.Event] = []"): "StragglerDetector type annotation",
    ("utils.py", "self.stop_gemm_ev: List[torch.cuda.Event] = []"): "StragglerDetector type annotation",
    ("utils.py", "self.start_data_ev: List[torch.cuda.Event] = []"): "StragglerDetector type annotation",
    ("utils.py", "self.stop_data_ev: List[torch.cuda.Event] = []"): "StragglerDetector type annotation",
    ("dist_checkpointing/strategies/torch.py", "if not torch.cuda.is_available():"): "works on CPU builds (False)",
}


def megatron_root() -> Path:
    import megatron.core

    return Path(megatron.core.__file__).parent


def scan_cuda_sites() -> list[tuple[str, str]]:
    """(file relative to megatron/core, stripped line) of every CUDA reference in SCANNED_FILES."""
    root = megatron_root()
    sites = []
    for rel in SCANNED_FILES:
        for line in (root / rel).read_text().splitlines():
            if _SITE.search(line):
                sites.append((rel, line.strip()))
    return sites


def auto_covered(rel: str, line: str) -> str | None:
    """How the proxy covers this site, or None if it does not."""
    from megarl.megatron.cpu_compat import PROXIED_MODULES, shim_attributes

    module = rel[:-3].replace("/", ".")
    if module not in PROXIED_MODULES or ".cuda(" in line or "Tensor'" in line:
        return None
    attrs = _CUDA_ATTR.findall(line)
    rest = _CUDA_ATTR.sub("", line)
    if any(a not in shim_attributes() for a in attrs):
        return None
    if re.search(r"[\"']cuda[\"']", rest) and not _FACTORY_ON_CUDA.search(line):
        return None
    return "proxy: " + ", ".join([f"torch.cuda.{a}" for a in attrs] or ["device='cuda' in a factory"])


def uncovered_sites() -> list[tuple[str, str]]:
    return [s for s in scan_cuda_sites() if s not in EXPLICIT_SITES and auto_covered(*s) is None]


def stale_explicit_sites() -> list[tuple[str, str]]:
    present = set(scan_cuda_sites())
    return [s for s in EXPLICIT_SITES if s not in present]
