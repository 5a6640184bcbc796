"""Padding removal and dynamic micro-batches in the Megatron engine: log-prob and update time of one
batch of responses of varied length, side by side, at two model sizes.

Settings (the engine's `use_sequence_packing` = `model.use_remove_padding`, and `use_dynamic_bsz`):
  padded          fixed micro-batches of `--micro-batch-size` rows, each trimmed to its longest row
  packed          the same rows concatenated into one sequence (block-diagonal causal mask)
  padded_dynamic  rows sorted by length, micro-batches closed at `--max-tokens` (rows x longest)
  packed_dynamic  packed micro-batches of at most `--max-tokens` tokens, balanced

One process (world of 1, gloo without CUDA), one engine per size; the settings run in turn within
each round so that a busy machine slows them alike; after one warm-up round (Adam's state is
created there) the median and the fastest of `--repeats` rounds are reported. On a shared machine
the fastest run is the better estimate of the cost itself; speedups are given for both. Log-probs of every setting are compared
with the padded ones (they must agree to fp32 rounding).

Useful-token MFU: the model FLOPs of the real tokens only (2 N per token forward, 6 N per token for
an update, N = parameters without the input embedding; attention's own FLOPs left out) per second,
over the fp32 matmul rate measured in the same process with the same threads (`torch.mm`, square
`--matmul-size`, before every round; the fastest is the machine's rate), from the fastest runs.

    python benchmarks/packing.py                 # about 6-10 minutes on 2 CPU cores
    python benchmarks/packing.py --sizes quickstart --repeats 1

Prints a table and writes JSON to --out (default benchmarks/results/packing.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, in_world_of_one, load_average, machine_info, matmul_flops, ratio, write_json  # noqa: E402

from megarl.layout import ParallelLayout  # noqa: E402
from megarl.megatron.engine import MegatronEngine  # noqa: E402
from megarl.megatron.optim import EngineConfig  # noqa: E402
from megarl.models.spec import ModelSpec  # noqa: E402

# (hidden, intermediate, layers, heads, kv heads, vocab)
SIZES = {
    "quickstart": (256, 512, 4, 4, 2, 64),  # configs/quickstart_cpu.yaml (character vocabulary)
    "qwen2_25m": (512, 1536, 8, 8, 4, 2048),
}
SETTINGS = {"padded": (False, False), "packed": (True, False),
            "padded_dynamic": (False, True), "packed_dynamic": (True, True)}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {','.join(SIZES)}")
    p.add_argument("--rows", type=int, default=64, help="sequences in the batch (8 prompts x 8)")
    p.add_argument("--max-prompt-len", type=int, default=16)
    p.add_argument("--max-response-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=0, help="dynamic budget; 0: micro-batch-size x longest row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--matmul-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--out", default=str(RESULTS_DIR / "packing.json"))
    return p.parse_args(argv)


def make_batch(args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts of 4..max_prompt_len tokens, right-padded responses of 1..max_response_len."""
    g = torch.Generator().manual_seed(0)
    p_len, r_len = args.max_prompt_len, args.max_response_len
    prompts = torch.randint(4, p_len + 1, (args.rows,), generator=g)
    responses = torch.randint(1, r_len + 1, (args.rows,), generator=g)
    ids = torch.randint(1, vocab, (args.rows, p_len + r_len), generator=g)
    cols = torch.arange(p_len + r_len).unsqueeze(0)
    mask = ((cols >= p_len - prompts.unsqueeze(1)) & (cols < p_len + responses.unsqueeze(1))).long()
    ids = ids * mask
    response_mask = mask[:, p_len:].float()
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, p_len:], "response_mask": response_mask,
            "advantages": torch.randn(args.rows, r_len, generator=g) * response_mask}


def pg_loss(outputs: dict[str, torch.Tensor], mb: dict[str, torch.Tensor], n: Any) -> tuple[torch.Tensor, dict]:
    loss = -(outputs["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / n.global_num_tokens * n.dp_size
    return loss, {}


def _timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_size(name: str, args: argparse.Namespace) -> dict[str, Any]:
    hidden, inter, layers, heads, kv, vocab = SIZES[name]
    hf_config = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=vocab, hidden_size=hidden,
                     intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=kv, hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                     max_position_embeddings=args.max_prompt_len + args.max_response_len)
    width = args.max_prompt_len + args.max_response_len
    max_tokens = args.max_tokens or args.micro_batch_size * width
    base = EngineConfig(micro_batch_size=args.micro_batch_size, lr=1e-6, clip_grad=1.0,
                        max_token_len_per_micro_batch=max_tokens)
    engine = MegatronEngine(ModelSpec.from_hf_config(hf_config), ParallelLayout(), base)
    batch = make_batch(args, vocab)
    params = sum(p.numel() for _, p in engine.get_named_weights())
    flop_params = params - vocab * hidden  # the input embedding is a lookup
    useful = int(batch["attention_mask"].sum())
    configs = {s: dataclasses.replace(base, use_sequence_packing=pk, use_dynamic_bsz=dyn)
               for s, (pk, dyn) in SETTINGS.items()}
    times: dict[str, dict[str, list[float]]] = {s: {"log_prob": [], "update": []} for s in SETTINGS}
    rates: list[float] = []
    log_probs: dict[str, torch.Tensor] = {}
    micro: dict[str, int] = {}
    for setting, cfg in configs.items():  # every setting's log-probs of the same weights
        engine.cfg = cfg
        log_probs[setting] = engine.compute_log_prob(batch)["log_probs"]
        micro[setting] = len(engine._micro_batches(batch))
    for round_ in range(args.repeats + 1):
        rates.append(matmul_flops(args.matmul_size))
        for setting, cfg in configs.items():
            engine.cfg = cfg
            t_lp, _ = _timed(lambda: engine.compute_log_prob(batch))
            t_up, _ = _timed(lambda: engine.train_step(batch, pg_loss, mini_batch_size=args.rows))
            if round_ == 0:  # warm-up: Adam's state is created here
                continue
            times[setting]["log_prob"].append(t_lp)
            times[setting]["update"].append(t_up)
    engine.cfg = base
    mask = batch["response_mask"].bool()
    rate = max(rates)
    result: dict[str, Any] = {"hf_config": hf_config, "params": params, "flop_params": flop_params,
                              "matmul_fp32_flops_runs": rates, "matmul_fp32_flops": rate,
                              "rows": args.rows, "useful_tokens": useful, "padded_tokens": args.rows * width,
                              "max_tokens": max_tokens, "settings": {}}
    for setting in SETTINGS:
        t, ref = times[setting], times["padded"]
        lp, up = statistics.median(t["log_prob"]), statistics.median(t["update"])
        lp_min, up_min = min(t["log_prob"]), min(t["update"])
        diff = (log_probs[setting] - log_probs["padded"]).abs()[mask].max().item()
        result["settings"][setting] = {
            "log_prob_s": lp, "update_s": up, "log_prob_min_s": lp_min, "update_min_s": up_min,
            "log_prob_runs_s": t["log_prob"], "update_runs_s": t["update"], "micro_batches": micro[setting],
            "log_prob_speedup_vs_padded": ratio(statistics.median(ref["log_prob"]), lp),
            "update_speedup_vs_padded": ratio(statistics.median(ref["update"]), up),
            "log_prob_speedup_vs_padded_min": ratio(min(ref["log_prob"]), lp_min),
            "update_speedup_vs_padded_min": ratio(min(ref["update"]), up_min),
            "mfu_log_prob": 2.0 * flop_params * useful / lp_min / rate,
            "mfu_update": 6.0 * flop_params * useful / up_min / rate,
            "max_abs_log_prob_diff_vs_padded": diff,
        }
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    names = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in names if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; known: {list(SIZES)}")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    load_before = load_average()
    sizes = in_world_of_one(lambda layout: {name: bench_size(name, args) for name in names})
    write_json(args.out, {"section": "packing", "machine": machine_info(), "threads": args.threads,
                          "load_average_before": load_before, "load_average_after": load_average(),
                          "repeats": args.repeats, "micro_batch_size": args.micro_batch_size, "sizes": sizes})
    print("times: median (fastest) of the rounds; x: speedup over padded, median (fastest); MFU from the fastest")
    print(f"{'size':<11} {'setting':<15} {'mb':>3} {'log_prob s':>14} {'x':>11} {'update s':>14} {'x':>11} "
          f"{'MFU lp':>7} {'MFU up':>7} {'|dlp|':>8}")
    for name, res in sizes.items():
        for setting, s in res["settings"].items():
            print(f"{name:<11} {setting:<15} {s['micro_batches']:>3} "
                  f"{s['log_prob_s']:>6.3f} ({s['log_prob_min_s']:.3f}) "
                  f"{s['log_prob_speedup_vs_padded']:>4.2f} ({s['log_prob_speedup_vs_padded_min']:.2f}) "
                  f"{s['update_s']:>6.3f} ({s['update_min_s']:.3f}) "
                  f"{s['update_speedup_vs_padded']:>4.2f} ({s['update_speedup_vs_padded_min']:.2f}) "
                  f"{s['mfu_log_prob']:>7.1%} {s['mfu_update']:>7.1%} {s['max_abs_log_prob_diff_vs_padded']:>8.1e}")
        print(f"{name:<11} {res['params'] / 1e6:.1f}M params, {res['useful_tokens']} real of "
              f"{res['padded_tokens']} tokens, budget {res['max_tokens']}, fp32 matmul "
              f"{res['matmul_fp32_flops'] / 1e9:.1f} GFLOP/s (fastest of {len(res['matmul_fp32_flops_runs'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
