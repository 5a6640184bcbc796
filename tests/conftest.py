"""Test-suite wide settings: tier markers, thread limits, skips for hardware this machine lacks."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Two cores shared by multi-process tests: one intra-op thread per process keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test clusters only
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _vllm_installed() -> bool:
    """True when a real vLLM is installed (a tests directory named vllm could look like a namespace package)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    has_vllm = _vllm_installed()
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in ("distributed", "integration", "vllm", "gpu", "slow")):
            item.add_marker(pytest.mark.unit)
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA: run the gpu tier on a GPU machine"))
        if item.get_closest_marker("vllm") and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM: run `make test-vllm` (CPU build in .venv-vllm)"))
