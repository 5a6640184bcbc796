"""The HF rollout engine's KV cache against transformers' DynamicCache, side by side in one run.

transformers' `DynamicCache` concatenates each layer's keys and values anew at every decoded
token; the engine writes them into a buffer sized for the generation (`_PreallocatedLayer`).
Both run the same `HFRolloutEngine.generate` on the same prompts and seed (the cache factory is
swapped between calls), alternating, after one warm-up each; the samples must come out equal.
The default model is the ~25M Qwen2 of `benchmarks/e2e.py --size 25m` (hidden 512, 8 layers,
intermediate 1536, 8/4 heads), 32 rows (one DP rank's share of 8 prompts x 8) of 64 tokens.

    python benchmarks/kv_cache.py                  # about a minute on 2 CPU cores

Prints a table and writes JSON to --out (default benchmarks/results/kv_cache.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, ratio, write_json  # noqa: E402

import megarl.rollout.hf_engine as hf_engine  # noqa: E402
from megarl.protocol import Batch  # noqa: E402
from megarl.rollout import EngineOptions, SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: one rollout worker's share)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "kv_cache.json")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.tokens,
                         tie_word_embeddings=False)
    engine = hf_engine.HFRolloutEngine.from_config(config, EngineOptions(pad_token_id=0, eos_token_ids=()))
    ids = torch.randint(1, 64, (args.rows, args.prompt), generator=torch.Generator().manual_seed(1))
    prompts = Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    params = SamplingParams(n=1, max_new_tokens=args.tokens, seed=3)
    factories = {"dynamic_cache": lambda cfg, capacity: DynamicCache(config=cfg),
                 "preallocated": hf_engine._preallocated_cache}
    seconds: dict[str, list[float]] = {name: [] for name in factories}
    outputs = {}
    for round_ in range(args.repeats + 1):
        for name, factory in factories.items():
            hf_engine._preallocated_cache = factory
            start = time.perf_counter()
            outputs[name] = engine.generate(prompts, params)
            if round_:  # round 0 warms up
                seconds[name].append(time.perf_counter() - start)
    hf_engine._preallocated_cache = factories["preallocated"]
    same = torch.equal(outputs["dynamic_cache"]["responses"], outputs["preallocated"]["responses"]) and torch.equal(
        outputs["dynamic_cache"]["rollout_log_probs"], outputs["preallocated"]["rollout_log_probs"])
    tokens = args.rows * args.tokens
    results = {name: {"median_s": statistics.median(s), "fastest_s": min(s), "tokens_per_s": tokens / statistics.median(s)}
               for name, s in seconds.items()}
    speedup = ratio(results["dynamic_cache"]["median_s"], results["preallocated"]["median_s"])
    for name, row in results.items():
        print(f"{name:14} median {row['median_s']:.3f} s  fastest {row['fastest_s']:.3f} s  {row['tokens_per_s']:.0f} tokens/s")
    print(f"preallocated / dynamic_cache speedup {speedup:.2f}x; same samples and log-probs: {same}")
    params_count = sum(t.numel() for t in engine.model.parameters())
    write_json(args.out, {"section": "kv_cache", "machine": machine_info(),
                          "setup": {**{k: v for k, v in vars(args).items() if k != "out"}, "parameters": params_count},
                          "results": results, "speedup": speedup, "same_samples": same})
    print(f"wrote {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
