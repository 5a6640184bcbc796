"""Run Megatron-Core's training path on a machine without CUDA.

Megatron-Core 0.16.1 calls CUDA directly in a few places even when every tensor lives on the CPU
(RNG tracker, `torch.cuda.current_device()` as a device argument, `device="cuda"` scratch tensors,
`torch.cuda.synchronize()`, and `param.type() == "torch.cuda.FloatTensor"` checks in the optimizer).
This layer makes those calls CPU calls, and does nothing when CUDA is available.

How (narrowest point first):
- Each Megatron module on the training path sees, as its module-global `torch`, a proxy that forwards
  every attribute to the real torch except `torch.cuda` (a CPU stand-in, `_CpuCudaShim`) and the
  tensor factories (`zeros`, `ones`, `empty`, `tensor`, `full`, `arange`, `empty_like`), which map
  `device="cuda"` to the CPU. The real `torch` module is never modified.
- The two RNG helpers `_get_cuda_rng_state`/`_set_cuda_rng_state` of `tensor_parallel.random` are
  replaced by module attributes backed by a dedicated CPU generator (the "device" generator).
  Otherwise `_set_cuda_rng_state` silently queues a lazy CUDA call on every fork (unbounded growth).
- Tensor-type string checks and `tensor.cuda()` cannot be reached through a module attribute (they
  are tensor methods), so the few functions that contain them run with `torch.Tensor.type`
  reporting CPU tensors under their CUDA names and `torch.Tensor.cuda` returning the tensor itself.
  This is the only global patch, scoped to those calls (and guarded by a lock).

`COVERED_CUDA_SITES` (in `cpu_compat_sites`) lists every CUDA reference in the scanned Megatron
files and how it is handled; a unit test rescans the installed Megatron and fails on any new one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import types
import warnings
from typing import Any, Callable, Iterator

import torch

MEGATRON_CORE_VERSION = "0.16.1"

# Modules whose global `torch` is replaced by the proxy (relative to megatron.core).
PROXIED_MODULES: tuple[str, ...] = (
    "tensor_parallel.random",
    "models.common.embeddings.rotary_pos_embedding",
    "utils",
    "distributed.param_and_grad_buffer",
    "pipeline_parallel.p2p_communication",
    "pipeline_parallel.schedules",
    "optimizer.optimizer",
    "optimizer.clip_grads",
    "optimizer.distrib_optimizer",
    "transformer.utils",
    # Context parallel RoPE: get_pos_emb_on_this_cp_rank builds its index with pin_memory=True.
    "models.common.embeddings.rope_utils",
    "dist_checkpointing.strategies.filesystem_async",
    "dist_checkpointing.strategies.state_dict_saver",
    # Sequence parallelism: the gather and reduce-scatter buffers of tensor_parallel.layers and
    # .mappings are made with device=torch.cuda.current_device(). The collectives themselves need
    # nothing: gloo in the pinned torch (2.13) has all_gather_into_tensor and reduce_scatter_tensor
    # (also async), which tests/distributed/test_engine_sp.py runs.
    "tensor_parallel.layers",
    "tensor_parallel.mappings",
    # Not reached by the CPU configuration today (GPU initialisation, fp16 loss scaling), proxied
    # anyway so that a configuration change does not meet a CUDA call.
    "tensor_parallel.utils",
    "models.gpt.gpt_model",
    "transformer.dot_product_attention",
    "transformer.attention",
    "transformer.transformer_layer",
    "optimizer.grad_scaler",
    # Mixture-of-experts layers (router, token dispatcher, experts, shared experts).
    "transformer.moe.moe_layer",
    "transformer.moe.moe_utils",
    "transformer.moe.router",
    "transformer.moe.token_dispatcher",
    "transformer.moe.experts",
    "transformer.moe.shared_experts",
)

# (module, qualified function) that compare `tensor.type()` with CUDA type names or call
# `tensor.cuda()`: they run with those two tensor methods CPU-friendly (see `_cpu_tensor_methods`).
TENSOR_METHOD_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("models.common.language_module.language_module", "LanguageModule.setup_embeddings_and_output_layer"),
    ("optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"),
    ("optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),  # .cuda(non_blocking=True)
)

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "empty_like", "zeros_like")
_CPU = torch.device("cpu")


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CpuCudaShim(types.SimpleNamespace):
    """What Megatron sees as `torch.cuda` on a CPU machine: one CPU 'device', its own generator."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator(device="cpu")
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state)

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU kernels are synchronous: nothing to wait for."""

    @staticmethod
    def empty_cache() -> None:
        """The CPU allocator has no cache to release."""

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        self.generator.set_state(state)

    def manual_seed(self, seed: int) -> None:
        self.generator.manual_seed(int(seed))

    # Streams and events: the MoE token dispatcher overlaps device-to-host copies on a side
    # stream; CPU kernels run in program order, so one no-op stream stands for all of them.
    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> "_CpuStream":  # noqa: N802 (torch's name)
        return _CPU_STREAM

    @staticmethod
    def current_stream(device: Any = None) -> "_CpuStream":
        return _CPU_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> "_CpuEvent":  # noqa: N802 (torch's name)
        return _CpuEvent()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"megarl CPU compatibility layer: Megatron-Core called torch.cuda.{name}, which the "
            f"layer does not cover (written for megatron-core {MEGATRON_CORE_VERSION})"
        )


class _CpuEvent:
    """A CUDA event on the CPU: everything before it has already happened."""

    def record(self, stream: Any = None) -> None:
        """Nothing to mark: CPU work is complete when the call returns."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CUDA stream on the CPU: work is already ordered, so waits and records are no-ops."""

    def wait_stream(self, other: Any) -> None:
        """Program order already holds."""

    def wait_event(self, event: Any) -> None:
        """Program order already holds."""

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        """Nothing to wait for."""


_CPU_STREAM = _CpuStream()


class _CpuTorchProxy(types.ModuleType):
    """The real `torch`, except `cuda` and `device="cuda"` in tensor factories."""

    def __init__(self, shim: _CpuCudaShim) -> None:
        super().__init__("torch")
        self.cuda = shim
        for name in _FACTORIES:
            setattr(self, name, self._cpu_factory(getattr(torch, name)))

    @staticmethod
    def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(factory)
        def make(*args: Any, **kwargs: Any) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _to_cpu_device(kwargs["device"])
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_type_patch_lock = threading.RLock()
_type_patch_depth = 0
_saved_methods: dict[str, Any] = {}


@contextlib.contextmanager
def _cpu_tensor_methods() -> Iterator[None]:
    """While active, `tensor.type()` (no arguments) of a CPU float tensor returns its CUDA name and
    `tensor.cuda()` returns the tensor itself."""
    global _type_patch_depth
    with _type_patch_lock:
        if _type_patch_depth == 0:
            original_type = torch.Tensor.type

            def type_as_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                result = original_type(self, *args, **kwargs)
                if args or kwargs:
                    return result
                return _CUDA_TYPE_NAMES.get(result, result)

            def stay_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                return self

            _saved_methods.update(type=torch.Tensor.type, cuda=torch.Tensor.cuda)
            torch.Tensor.type = type_as_cuda  # type: ignore[method-assign]
            torch.Tensor.cuda = stay_on_cpu  # type: ignore[method-assign]
        _type_patch_depth += 1
        try:
            yield
        finally:
            _type_patch_depth -= 1
            if _type_patch_depth == 0:
                torch.Tensor.type = _saved_methods.pop("type")  # type: ignore[method-assign]
                torch.Tensor.cuda = _saved_methods.pop("cuda")  # type: ignore[method-assign]


def _with_cuda_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _cpu_tensor_methods():
            return fn(*args, **kwargs)

    call._megarl_wrapped = fn  # type: ignore[attr-defined]
    return call


_applied = False
_shim: _CpuCudaShim | None = None


def check_megatron_version() -> None:
    """Raise if the installed megatron-core is not the version this layer was written for."""
    import megatron.core

    found = getattr(megatron.core, "__version__", "unknown")
    if found != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"megarl's CPU compatibility layer was written for megatron-core "
            f"{MEGATRON_CORE_VERSION}, found {found}: re-verify megarl/megatron/cpu_compat.py "
            f"(run tests/unit/megatron/test_cpu_compat.py) and update the pin"
        )


def apply_cpu_compat(force: bool = False) -> bool:
    """Install the layer if CUDA is absent (or `force`). Idempotent. Returns True if installed."""
    global _applied, _shim
    if _applied:
        return True
    if torch.cuda.is_available() and not force:
        return False
    check_megatron_version()
    _shim = _CpuCudaShim()
    proxy = _CpuTorchProxy(_shim)
    for rel in PROXIED_MODULES:
        module = importlib.import_module(f"megatron.core.{rel}")
        module.torch = proxy  # type: ignore[attr-defined]
    _patch_rng_helpers(_shim)
    _patch_moe_host_copies()
    for rel, qualname in TENSOR_METHOD_FUNCTIONS:
        _wrap_type_checking_function(rel, qualname)
    _applied = True
    return True


def define_missing_te_symbols() -> None:
    """Without TransformerEngine, megatron-core 0.16.1's MoE router refers to `te_general_gemm`,
    a name its moe_utils only defines when TE imports (NameError in RouterGatingLinearFunction).
    Define it as None there so the router takes its torch.mm path. Needed with or without CUDA, so
    it is called where a MoE config is built (`ModelSpec.transformer_config`), not by the CPU layer."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _patch_moe_host_copies() -> None:
    """The alltoall token dispatcher turns its split sizes into numpy arrays while copying them
    from the GPU (`maybe_move_tensor_to_cpu(..., as_numpy=True)`); a tensor already on the CPU is
    returned unchanged, and `all_to_all_single` refuses tensor split sizes. Convert it here too."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    for rel in ("transformer.moe.moe_utils", "transformer.moe.token_dispatcher"):
        module = importlib.import_module(f"megatron.core.{rel}")
        if getattr(module, "maybe_move_tensor_to_cpu", None) is original:
            module.maybe_move_tensor_to_cpu = to_host  # type: ignore[attr-defined]


def is_applied() -> bool:
    return _applied


def _patch_rng_helpers(shim: _CpuCudaShim) -> None:
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
        return shim.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        shim.set_rng_state(new_state)

    random_mod._get_cuda_rng_state = get_state  # type: ignore[attr-defined]
    random_mod._set_cuda_rng_state = set_state  # type: ignore[attr-defined]


def _wrap_type_checking_function(rel: str, qualname: str) -> None:
    module = importlib.import_module(f"megatron.core.{rel}")
    parts = qualname.split(".")
    if len(parts) == 1:
        fn = getattr(module, parts[0])
        wrapped = _with_cuda_type_names(fn)
        setattr(module, parts[0], wrapped)
        # Callers that imported the function by name hold their own reference: rebind it there.
        for caller_rel in ("optimizer.optimizer", "optimizer.distrib_optimizer", "optimizer",
                           "models.common.embeddings.rotary_pos_embedding"):
            caller = importlib.import_module(f"megatron.core.{caller_rel}")
            if getattr(caller, parts[0], None) is fn:
                setattr(caller, parts[0], wrapped)
        return
    cls = getattr(module, parts[0])
    raw = cls.__dict__[parts[1]]
    if isinstance(raw, staticmethod):
        setattr(cls, parts[1], staticmethod(_with_cuda_type_names(raw.__func__)))
    elif isinstance(raw, classmethod):
        setattr(cls, parts[1], classmethod(_with_cuda_type_names(raw.__func__)))
    else:
        setattr(cls, parts[1], _with_cuda_type_names(raw))


def warn_if_cuda_missing_without_layer() -> None:
    if not torch.cuda.is_available() and not _applied:
        warnings.warn("CUDA is absent and megarl's CPU compatibility layer is not applied")


def shim_attributes() -> frozenset[str]:
    """The `torch.cuda` attributes the CPU stand-in provides."""
    return frozenset(
        name for name in dir(_CpuCudaShim) if not name.startswith("_")
    ) | {"random", "generator"}
