"""vLLM with tensor parallelism 2, one rank per process (SPMD, external launcher), against HF.

Two processes started by torchrun each hold one vLLM tensor-parallel rank; weights are updated with
full HF tensors and each rank keeps its own slice.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: build the CPU environment with tools/vllm_env.sh")

from megarl.data.padding import left_pad  # noqa: E402
from megarl.protocol import Batch  # noqa: E402
from megarl.rollout import EngineOptions, SamplingParams  # noqa: E402
from megarl.rollout.hf_engine import HFRolloutEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

R = 6
PROMPTS = [[5, 17, 42, 8], [33, 2], [71, 70, 69, 68, 67, 3]]


def tiny_model(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prompt_tensors() -> dict[str, torch.Tensor]:
    input_ids, attention_mask, _ = left_pad(PROMPTS, 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def hf_greedy(model: torch.nn.Module) -> Batch:
    engine = HFRolloutEngine(model, EngineOptions(pad_token_id=0, eos_token_ids=()))
    return engine.generate(Batch.from_dict(prompt_tensors()), SamplingParams.make_greedy(R))


def free_port() -> int:
    # torchrun's --master-port=0 left the ranks waiting for each other: pick a free port ourselves.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_tensor_parallel_2_matches_hf_and_takes_full_tensor_updates(tmp_path: Path) -> None:
    model = tiny_model(seed=0)
    model.save_pretrained(tmp_path / "model")
    generator = torch.Generator().manual_seed(1)
    new_state = {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in model.state_dict().items()}
    torch.save(prompt_tensors(), tmp_path / "prompts.pt")
    torch.save(new_state, tmp_path / "new_state.pt")

    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_LOGGING_LEVEL="ERROR")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(Path(__file__).with_name("tp_rank_main.py")), str(tmp_path / "model"), str(tmp_path), str(R),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    expected_before = hf_greedy(model)
    new_model = tiny_model(seed=0)
    new_model.load_state_dict(new_state)
    expected_after = hf_greedy(new_model)
    full_qkv_rows = 3 * 2 * 64  # q, k, v of 2 heads x head_dim 64
    for rank in range(2):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(seen["before"], expected_before["responses"]), f"rank {rank}"
        assert torch.equal(seen["after"], expected_after["responses"]), f"rank {rank}"
        torch.testing.assert_close(seen["after_log_probs"], expected_after["rollout_log_probs"], atol=1e-4, rtol=0)
        # each rank holds half of the fused q/k/v rows and of gate/up
        assert seen["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == (full_qkv_rows // 2, 128)
        assert seen["shapes"]["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 256 // 2, 128)
        assert seen["all_reduce"] == 3.0
