"""The CPU compatibility layer: covers every CUDA call on the training path, applies only without CUDA."""

from __future__ import annotations

import pytest
import torch

from megarl.megatron import cpu_compat
from megarl.megatron.cpu_compat_sites import (
    EXPLICIT_SITES,
    auto_covered,
    scan_cuda_sites,
    stale_explicit_sites,
    uncovered_sites,
)


def test_every_cuda_site_on_the_training_path_is_covered() -> None:
    sites = scan_cuda_sites()
    assert len(sites) > 100  # the scan reads the installed sources
    missing = uncovered_sites()
    assert not missing, "Megatron-Core CUDA calls the CPU layer does not cover:\n" + "\n".join(map(str, missing))


def test_explicit_site_list_has_no_stale_entries() -> None:
    assert not stale_explicit_sites(), "entries no longer in megatron-core: update cpu_compat_sites.py"


def test_site_classification_rejects_unknown_calls() -> None:
    # A call the shim does not implement, in a proxied module, is not covered.
    assert auto_covered("pipeline_parallel/schedules.py", "torch.cuda.mem_get_info()") is None
    assert auto_covered("pipeline_parallel/schedules.py", 'x = torch.zeros(3, device="cuda")') is not None
    # A helper called with a CUDA device outside a factory is not covered either.
    assert auto_covered("pipeline_parallel/schedules.py", 'foo(device="cuda")') is None
    # Any site in a module that is not proxied needs an explicit entry.
    assert auto_covered("transformer/mlp.py", "torch.cuda.synchronize()") is None
    assert all(reason for reason in EXPLICIT_SITES.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer must stay off with CUDA")
def test_layer_is_applied_and_makes_cuda_calls_cpu_calls() -> None:
    assert cpu_compat.apply_cpu_compat() is True and cpu_compat.is_applied()
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as mrandom

    assert schedules.torch.zeros([], device="cuda").device.type == "cpu"
    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.current_device is not schedules.torch.cuda.current_device  # real torch untouched
    state = mrandom._get_cuda_rng_state()
    first = torch.rand(3, generator=schedules.torch.cuda.generator)
    mrandom._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(3, generator=schedules.torch.cuda.generator), first)
    with pytest.raises(AttributeError, match="does not cover"):
        schedules.torch.cuda.mem_get_info()


def test_tensor_methods_patch_is_scoped_to_the_wrapped_call() -> None:
    t = torch.zeros(2)
    with cpu_compat._cpu_tensor_methods():
        assert t.type() == "torch.cuda.FloatTensor" and t.cuda() is t
        assert t.type(torch.float64).dtype == torch.float64
    assert t.type() == "torch.FloatTensor"


def test_version_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron.core

    cpu_compat.check_megatron_version()
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="0.16.1"):
        cpu_compat.check_megatron_version()
