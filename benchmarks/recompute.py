"""Activation recompute in the Megatron engine: peak memory of one train step and its time, without
recompute, with "selective" (core attention) and with "full" (every layer) recompute.

Each setting runs in a fresh subprocess (world of 1, gloo without CUDA): build the engine, take one
train step (Adam's state is created then), time `--repeats` more steps, then profile one step.

What is measured, and why it is honest on a CPU:
- `step_alloc_peak_mib`: torch's profiler (`profile_memory=True`) records every tensor allocation
  and free of the profiled step; its memory timeline (`export_memory_timeline`, device "cpu") gives
  the bytes live at each moment. The peak, over the step, of the bytes allocated during the step is
  what the step needs on top of the model: activations kept for the backward pass, temporaries and
  gradients before they reach Megatron's gradient buffers. Parameters, gradient buffers and
  optimizer state existed before the step and are not counted.
- `max_rss_mib`: the subprocess's peak resident set size (getrusage), the whole process (torch
  libraries, model, optimizer state included): an outside view of the same difference, in MiB of
  the operating system's accounting (the allocator may keep freed memory).

    python benchmarks/recompute.py                       # about 2 minutes on 2 CPU cores
    python benchmarks/recompute.py --layers 4 --prompt-len 64 --response-len 64 --repeats 1

Prints a table and writes JSON to --out (default benchmarks/results/recompute.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import RESULTS_DIR, machine_info, ratio, write_json  # benchmarks/common.py (run from the repo root)

GRANULARITIES = ("none", "selective", "full")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--out", default=str(RESULTS_DIR / "recompute.json"))
    p.add_argument("--worker", choices=GRANULARITIES, help=argparse.SUPPRESS)  # one setting, JSON on stdout
    return p.parse_args()


def make_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Full-length rows (no padding): every setting computes the same tokens."""
    g = torch.Generator().manual_seed(1)
    width = args.prompt_len + args.response_len
    ids = torch.randint(0, args.vocab, (args.batch, width), generator=g)
    mask = torch.ones(args.batch, width, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, args.prompt_len:],
            "response_mask": mask[:, args.prompt_len:].float(),
            "advantages": torch.randn(args.batch, args.response_len, generator=g)}


def pg_loss(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], n: Any) -> tuple[torch.Tensor, dict]:
    loss = -(outputs["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / n.global_num_tokens * n.dp_size
    return loss, {}


def timeline_peak(prof: Any) -> int:
    """Peak bytes live, among those allocated during the profiled region (all categories)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)  # [times, bytes per category at each time]
    return max(sum(s) for s in sizes)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    from torch.profiler import ProfilerActivity, profile

    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import destroy_distributed, init_distributed
    from megarl.models.spec import ModelSpec

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    hf_config = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=args.vocab,
                     hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                     num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, hidden_act="silu",
                     max_position_embeddings=args.prompt_len + args.response_len, rms_norm_eps=1e-6,
                     tie_word_embeddings=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = init_distributed(0, 1, "127.0.0.1", port, ParallelLayout())
    granularity = None if args.worker == "none" else args.worker
    engine = MegatronEngine(ModelSpec.from_hf_config(hf_config), layout, EngineConfig(
        micro_batch_size=args.micro_batch_size, lr=1e-5, clip_grad=1.0, recompute_granularity=granularity))
    batch = make_batch(args)

    def step() -> dict[str, Any]:
        return engine.train_step(batch, pg_loss, mini_batch_size=args.batch)

    step()  # Adam's state is created in the first step
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        metrics = step()
    peak = timeline_peak(prof)
    destroy_distributed()
    return {
        "recompute_granularity": args.worker,
        "step_alloc_peak_mib": peak / 2**20,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "step_s": statistics.median(times),
        "loss": metrics["loss"][-1],
        "params": sum(p.numel() for _, p in engine.get_named_weights()),
    }


def main() -> None:
    args = _parse()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    here = Path(__file__).resolve().parent
    results = {}
    for name in GRANULARITIES:
        cmd = [sys.executable, str(here / "recompute.py"), "--worker", name]
        for key, value in vars(args).items():
            if key not in ("worker", "out"):
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=here.parent,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if proc.returncode != 0:
            raise RuntimeError(f"recompute={name} failed:\n{proc.stderr[-4000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = results["none"]
    for r in results.values():
        r["step_alloc_peak_ratio"] = ratio(r["step_alloc_peak_mib"], base["step_alloc_peak_mib"])
        r["max_rss_ratio"] = ratio(r["max_rss_mib"], base["max_rss_mib"])
        r["step_time_ratio"] = ratio(r["step_s"], base["step_s"])
    tokens = args.batch * (args.prompt_len + args.response_len)
    print(f"Qwen2-style {base['params'] / 1e6:.1f}M params, {args.layers} layers, hidden {args.hidden}, fp32, "
          f"{args.batch} x {args.prompt_len}+{args.response_len} tokens ({tokens}) in micro-batches of "
          f"{args.micro_batch_size}, {args.threads} threads")
    header = ["recompute", "step peak MiB", "x none", "max RSS MiB", "x none", "step s", "x none"]
    print("".join(f"{h:>14s}" for h in header))
    for name, r in results.items():
        row = [name, f"{r['step_alloc_peak_mib']:.0f}", f"{r['step_alloc_peak_ratio']:.2f}",
               f"{r['max_rss_mib']:.0f}", f"{r['max_rss_ratio']:.2f}", f"{r['step_s']:.2f}",
               f"{r['step_time_ratio']:.2f}"]
        print("".join(f"{c:>14s}" for c in row))
    losses = {r["loss"] for r in results.values()}
    print(f"losses of the profiled step: {sorted(losses)}")
    out = write_json(args.out, {"benchmark": "recompute", "args": {k: v for k, v in vars(args).items() if k != "worker"},
                                "tokens_per_step": tokens, "machine": machine_info(), "results": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
