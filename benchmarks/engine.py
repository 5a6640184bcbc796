"""Megatron engine vs HF transformers on the same model: log-prob and train-step throughput, memory.

Both sides compute the per-token log-probs of the response tokens of one batch (left-padded
prompts, right-padded responses of varied length), fp32 unless --dtype bf16. The train step is one
AdamW update over the batch with a token-mean policy-gradient loss (engine: Megatron DDP +
distributed optimizer, micro-batched, padded per micro-batch or packed into one row; HF: one
forward/backward over the padded batch + torch AdamW). Tokens/s counts
valid (unpadded) tokens. Runs in this process as a world of 1 (gloo without CUDA, NCCL with it).

    python benchmarks/engine.py                      # ~1-2 min on 2 CPU cores
    python benchmarks/engine.py --hidden 512 --layers 8 --batch 64
    python benchmarks/engine.py --family qwen3_moe --out benchmarks/results/engine_moe.json
    python benchmarks/engine.py --profile DIR        # also: where each side's time goes (torch.profiler)
    python benchmarks/engine.py --group-size 8       # GRPO's layout: 8 rows per prompt; adds a third
                                                     # engine with prompt_sharing=always ("engine_shared")

Prints a table and writes JSON to --out (default benchmarks/results/engine.json).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from common import alternating_times, machine_info, write_json  # benchmarks/common.py (run as a script from the repo root)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _peak_device_mib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def _timed_interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, the calls alternating (`common.alternating_times`)."""
    return {name: statistics.median(t) for name, t in alternating_times(fns, repeats).items()}


def _profile(fns: dict[str, Callable[[], Any]], out_dir: str, top: int = 25) -> dict[str, list[dict]]:
    """One call of each function under torch.profiler (CPU, and CUDA when present): the `top`
    operators by self time on the device (or the CPU), written as a table to out_dir/<name>.txt and
    returned as rows (name, calls, self ms, share of the call's total self time)."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    summary = {}
    for name, fn in fns.items():
        fn()  # warm-up outside the trace
        with profile(activities=activities) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        events = prof.key_averages()
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
            f.write(events.table(sort_by=key, row_limit=60))
        attr = "self_device_time_total" if cuda else "self_cpu_time_total"
        total = sum(getattr(e, attr, 0) for e in events) or 1
        rows = sorted(events, key=lambda e: -getattr(e, attr, 0))[:top]
        summary[name] = [{"op": e.key, "calls": e.count, "self_ms": getattr(e, attr, 0) / 1e3,
                          "share": getattr(e, attr, 0) / total} for e in rows]
        print(f"profile {name}: " + ", ".join(f"{r['op']} {r['share']:.0%}" for r in summary[name][:6]))
    return summary


def make_batch(batch: int, prompt_len: int, response_len: int, vocab: int, seed: int,
               group_size: int = 1) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses of varied length; each run of `group_size` rows
    shares one prompt (GRPO's n samples per prompt)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, prompt_len + response_len, dtype=torch.long)
    for i in range(batch):
        if i % group_size == 0:
            pad = int(torch.randint(0, prompt_len // 2, (1,), generator=g))
        mask[i, :pad] = 0
        mask[i, prompt_len + int(torch.randint(response_len // 2, response_len + 1, (1,), generator=g)):] = 0
    ids = torch.randint(0, vocab, (batch, prompt_len + response_len), generator=g)
    ids[:, :prompt_len] = ids[::group_size, :prompt_len].repeat_interleave(group_size, 0)
    ids = ids * mask
    return {
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, prompt_len:], "response_mask": mask[:, prompt_len:].float(),
        "advantages": torch.randn(batch, response_len, generator=g),
    }


def hf_log_probs(model: torch.nn.Module, b: dict[str, torch.Tensor], prompt_len: int) -> torch.Tensor:
    r = b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    logp = torch.log_softmax(logits[:, prompt_len - 1:prompt_len + r - 1].float(), -1)
    return logp.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)


def pg_loss(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], n: Any) -> tuple[torch.Tensor, dict]:
    loss = -(outputs["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / n.global_num_tokens * n.dp_size
    return loss, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["qwen2", "qwen3_moe"], default="qwen2",
                        help="dense Qwen2, or Qwen3-MoE (--experts of width hidden/2, top --topk)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--group-size", type=int, default=1,
                        help="rows per prompt; above 1 a third engine shares each prompt (prompt_sharing=always)")
    # One intra-op thread by default: on a shared machine, OpenMP threads that wait on descheduled
    # siblings slow the many small kernels of both sides unevenly.
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--out", default="benchmarks/results/engine.json")
    parser.add_argument("--core-attention", choices=["local", "megatron"], default="local",
                        help="without TransformerEngine: megarl's LocalAttention (torch's fused kernel, the "
                             "default) or Megatron's DotProductAttention, for a before/after comparison")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="after timing, profile one log-prob pass and one train step of each side into DIR")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.core_attention == "megatron":
        import megarl.megatron.model

        megarl.megatron.model.with_local_attention = lambda layer_spec, config: layer_spec

    import transformers

    from megarl.megatron.engine import MegatronEngine

    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import destroy_distributed, init_distributed
    from megarl.models.spec import ModelSpec

    torch.manual_seed(0)
    common = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_len + args.response_len, tie_word_embeddings=False)
    if args.family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=args.topk,
                                             moe_intermediate_size=args.hidden // 2, norm_topk_prob=True)
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hf = model_cls(config).to(dtype)
    hf_dir = tempfile.mkdtemp(prefix="megarl_bench_")
    hf.save_pretrained(hf_dir)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    hf = hf.to(device)
    if args.group_size < 1 or args.batch % args.group_size:
        parser.error(f"--group-size {args.group_size} must be >= 1 and divide --batch {args.batch}")
    batch = make_batch(args.batch, args.prompt_len, args.response_len, args.vocab, seed=1,
                       group_size=args.group_size)
    dev_batch = {k: v.to(device) for k, v in batch.items()}
    tokens = int(batch["attention_mask"].sum())
    params = sum(p.numel() for p in hf.parameters())

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = init_distributed(0, 1, "127.0.0.1", port, ParallelLayout())
    def build(packed: bool, sharing: str = "never") -> MegatronEngine:
        eng = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, EngineConfig(
            micro_batch_size=args.micro_batch_size, dtype=args.dtype, lr=1e-5, clip_grad=1.0,
            use_sequence_packing=packed, prompt_sharing=sharing), use_te=False if sharing != "never" else None)
        eng.load_hf_weights(hf_dir)
        return eng

    engine, packed_engine = build(False), build(True)
    engines = {"engine": engine, "engine_packed": packed_engine}
    if args.group_size > 1:  # the local layer spec: TransformerEngine's attention takes no mask
        engines["engine_shared"] = build(False, "always")
    rss_after_build = _peak_rss_mib()

    results: dict[str, Any] = {}
    mask = batch["response_mask"].bool()

    def hf_forward() -> torch.Tensor:
        hf.eval()
        with torch.no_grad():
            return hf_log_probs(hf, dev_batch, args.prompt_len).float().cpu()

    ref = hf_forward()
    results["log_prob_max_abs_diff"] = max(
        float((e.compute_log_prob(batch)["log_probs"] - ref)[mask].abs().max()) for e in engines.values())
    t = _timed_interleaved({**{name: (lambda e=e: e.compute_log_prob(batch)) for name, e in engines.items()},
                            "hf": hf_forward}, args.repeats)
    results["log_prob_tokens_per_s"] = {k: tokens / v for k, v in t.items()}
    rss_after_logprob = _peak_rss_mib()

    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)

    def hf_train() -> None:
        hf.train()
        opt.zero_grad()
        lp = hf_log_probs(hf, dev_batch, args.prompt_len)
        m = dev_batch["response_mask"]
        loss = -(lp * dev_batch["advantages"] * m).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()

    t = _timed_interleaved({**{name: (lambda e=e: e.train_step(batch, pg_loss, mini_batch_size=args.batch))
                               for name, e in engines.items()}, "hf": hf_train}, args.repeats)
    results["train_step_tokens_per_s"] = {k: tokens / v for k, v in t.items()}
    if args.profile:
        results["profile"] = _profile({
            "log_prob_engine": lambda: engine.compute_log_prob(batch),
            "log_prob_engine_packed": lambda: packed_engine.compute_log_prob(batch),
            "log_prob_hf": hf_forward,
            "train_engine": lambda: engine.train_step(batch, pg_loss, mini_batch_size=args.batch),
            "train_engine_packed": lambda: packed_engine.train_step(batch, pg_loss, mini_batch_size=args.batch),
            "train_hf": hf_train}, args.profile)
    # Two offload/onload cycles: the first one also allocates the (pinned, on CUDA) host copies,
    # which torch's host allocator keeps for the second, the cost a training loop pays every step.
    cycles = []
    for _ in range(2):
        t0 = time.perf_counter()
        engine.offload_to_cpu()
        engine.onload()
        cycles.append(time.perf_counter() - t0)
    results["offload_onload_s"], results["offload_onload_again_s"] = cycles
    results["peak_rss_mib"] = {"after_build": rss_after_build, "after_log_prob": rss_after_logprob,
                               "after_train": _peak_rss_mib()}
    results["peak_device_mib"] = _peak_device_mib()
    destroy_distributed()

    lp, tr = results["log_prob_tokens_per_s"], results["train_step_tokens_per_s"]
    print(f"model: {args.family} {params / 1e6:.2f}M params, {args.dtype}, batch {args.batch} x "
          f"{args.prompt_len}+{args.response_len} ({tokens} valid tokens), {args.threads} threads, {device}")
    print(f"{'':24s}{'engine':>12s}{'packed':>12s}{'HF':>12s}{'engine/HF':>12s}{'packed/HF':>12s}")
    for name, row in (("log-prob tokens/s", lp), ("train-step tokens/s", tr)):
        print(f"{name:24s}{row['engine']:12.0f}{row['engine_packed']:12.0f}{row['hf']:12.0f}"
              f"{row['engine'] / row['hf']:12.2f}{row['engine_packed'] / row['hf']:12.2f}")
    if "engine_shared" in lp:
        print(f"shared prompts (groups of {args.group_size}): log-prob {lp['engine_shared'] / lp['engine']:.2f}x, "
              f"train step {tr['engine_shared'] / tr['engine']:.2f}x the padded engine")
    print(f"log-prob max |engine - HF| = {results['log_prob_max_abs_diff']:.2e}; "
          f"offload+onload {results['offload_onload_s'] * 1e3:.1f} ms (again {cycles[1] * 1e3:.1f} ms); peak RSS {results['peak_rss_mib']['after_train']:.0f} MiB")

    out = write_json(args.out, {
        "benchmark": "engine", "args": vars(args), "params": params, "valid_tokens": tokens,
        "device": str(device), "machine": machine_info(), **results,
    })
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
