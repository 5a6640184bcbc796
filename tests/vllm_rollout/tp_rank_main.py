"""One rank of the tensor-parallel vLLM test, started by torchrun (see test_vllm_tensor_parallel.py).

Each rank runs one vLLM tensor-parallel rank in its own process over a gloo group it created
first, generates greedily, takes a full-tensor weight update, generates again and saves what it
saw for the test process to check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from megarl.protocol import Batch
    from megarl.rollout import EngineOptions, SamplingParams
    from megarl.rollout.vllm_engine import VLLMRolloutEngine

    model_dir, work_dir = Path(sys.argv[1]), Path(sys.argv[2])
    prompts = torch.load(work_dir / "prompts.pt")
    new_state = torch.load(work_dir / "new_state.pt")
    max_new_tokens = int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    options = EngineOptions(
        pad_token_id=0, eos_token_ids=(), tensor_parallel_size=dist.get_world_size(),
        max_model_len=128, max_num_seqs=16, kv_cache_memory_gb=0.25,
    )
    engine = VLLMRolloutEngine(model_dir, options)
    batch = Batch.from_dict(prompts)
    greedy = SamplingParams.make_greedy(max_new_tokens)
    before = engine.generate(batch, greedy)
    engine.update_weights(new_state.items())
    after = engine.generate(batch, greedy)
    shapes = {name: tuple(p.shape) for name, p in engine.engine_model().named_parameters()}
    # our own collective still works next to vLLM's groups
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    torch.save(
        {
            "before": before["responses"], "before_log_probs": before["rollout_log_probs"],
            "after": after["responses"], "after_log_probs": after["rollout_log_probs"],
            "shapes": shapes, "all_reduce": total.item(),
        },
        work_dir / f"rank{rank}.pt",
    )
    engine.release()


if __name__ == "__main__":
    main()
