"""megarl.megatron: Megatron-Core training engine.

- parallel: `init_distributed` / `destroy_distributed` for a `megarl.layout.ParallelLayout` (gloo on
  CPU, NCCL on GPU), `current_ranks` (this process's `megarl.layout.RankCoord`)
- cpu_compat (+ cpu_compat_sites): makes Megatron-Core's CUDA-only calls CPU calls when CUDA is absent
- engine: `MegatronEngine` (log-probs, entropy, values, reward scores, train step, offload, checkpoints)
- model, optim, logprobs, packing, offload, checkpoint: one concern each, used by the engine

Submodules are imported on demand: importing this package does not import Megatron-Core.
"""
