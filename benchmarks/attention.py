"""Half-precision CPU training attention: the three ways `LocalAttention` could compute it, side by side.

`LocalAttention` computes the short rows of a bf16/fp16 CPU training step with `explicit_attention`
(separate fp32 operations, one batched matmul per key/value head; `prefers_explicit_attention`).
This benchmark times that against torch's two CPU kernels for the same call: the math kernel
(`SDPBackend.MATH`) and the flash kernel (torch's default). Two parts, each alternating the three
call by call, so that load from other processes falls on all of them alike:

- kernel: `LocalAttention` forward + backward alone at 8 query / 4 key-value heads of 64 (the 25M
  shape), rows x keys from 64 x 36 to 8 x 192, with a causal + left-padding mask; median ms.
- train_step: one Megatron engine train step (forward, backward, AdamW) of the ~25M model of
  benchmarks/e2e_25m.py in bf16, 32 rows of 4 prompt + 64 response tokens (one micro-batch, as one
  rank of the e2e run); median seconds and the median of each pair's ratio to explicit attention.

Runs in this process as a world of 1 (gloo), one torch thread.

    python benchmarks/attention.py [--repeats 10] [--out benchmarks/results/attention_bf16.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

import megarl.megatron.attention as attention
from common import alternating_times, in_world_of_one, load_average, machine_info, write_json  # benchmarks/common.py
from engine import make_batch, pg_loss
from megarl.layout import ParallelLayout
from megarl.megatron.engine import MegatronEngine
from megarl.megatron.optim import EngineConfig
from megarl.models.spec import ModelSpec

WAYS = ("explicit", "math", "flash")
SHAPES = ((64, 36), (32, 68), (16, 128), (8, 192))  # rows x keys
HEADS, GROUPS, HEAD_DIM = 8, 4, 64


@contextlib.contextmanager
def computed_by(way: str) -> Iterator[None]:
    """Within the block, `LocalAttention` computes its half-precision training rows `way`: with
    `explicit_attention` (as it does), or torch's math or flash kernel."""
    chooser = attention.prefers_explicit_attention
    if way != "explicit":
        attention.prefers_explicit_attention = lambda query, keys: False
    try:
        with sdpa_kernel(SDPBackend.MATH) if way == "math" else contextlib.nullcontext():
            yield
    finally:
        attention.prefers_explicit_attention = chooser


def summary(times: dict[str, list[float]], scale: float = 1.0) -> dict[str, Any]:
    """Median of each way (times `scale`), and each way's median pair ratio to explicit attention."""
    base = times["explicit"]
    return {
        "median": {way: statistics.median(t) * scale for way, t in times.items()},
        "ratio_to_explicit": {way: statistics.median(a / b for a, b in zip(t, base))
                              for way, t in times.items() if way != "explicit"},
    }


def masked_rows(rows: int, keys: int) -> torch.Tensor:
    """[rows, 1, keys, keys] True = masked: causal, the first 0..keys/2 keys of each row padding,
    every query seeing itself."""
    g = torch.Generator().manual_seed(0)
    pad = torch.randint(0, keys // 2, (rows,), generator=g)
    causal = torch.ones(keys, keys, dtype=torch.bool).triu(1)
    hides = torch.arange(keys)[None, :] < pad[:, None]
    return ((causal[None] | hides[:, None, :]) & ~torch.eye(keys, dtype=torch.bool)[None])[:, None]


def kernel_times(rows: int, keys: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, attention_dropout=0.0)
    layer = attention.LocalAttention(config, 1, AttnMaskType.causal, "self")  # the world of 1's groups
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(keys, rows, n, HEAD_DIM, generator=g).to(dtype).requires_grad_()
               for n in (HEADS, GROUPS, GROUPS))
    grad = torch.randn(keys, rows, HEADS * HEAD_DIM, generator=g).to(dtype)
    mask = masked_rows(rows, keys)

    def call(way: str) -> Callable[[], None]:
        def run() -> None:
            with computed_by(way):
                layer(q, k, v, mask).backward(grad)
        return run

    return summary(alternating_times({way: call(way) for way in WAYS}, repeats), scale=1e3)


def engine_25m(layout: ParallelLayout, dtype: str) -> tuple[MegatronEngine, dict[str, torch.Tensor]]:
    """A Megatron engine of the ~25M model of benchmarks/e2e_25m.py in `dtype` ("fp32", "bf16") and
    one rank's batch of the e2e run: 32 rows of 4 prompt + 64 response tokens (one micro-batch)."""
    torch.manual_seed(0)
    hf_config = transformers.Qwen2Config(
        vocab_size=32, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=HEADS,
        num_key_value_heads=GROUPS, max_position_embeddings=128, tie_word_embeddings=False)
    batch = make_batch(32, 4, 64, hf_config.vocab_size, seed=1)
    with tempfile.TemporaryDirectory(prefix="megarl_bench_25m_") as model_dir:
        model = transformers.Qwen2ForCausalLM(hf_config)
        (model.to(torch.bfloat16) if dtype == "bf16" else model).save_pretrained(model_dir)
        engine = MegatronEngine(ModelSpec.from_hf_config(model_dir), layout, EngineConfig(
            micro_batch_size=32, dtype=dtype, lr=1e-5, clip_grad=1.0, use_sequence_packing=False))
        engine.load_hf_weights(model_dir)
    return engine, batch


def step_times_25m(layout: ParallelLayout, dtype: str, ways: tuple[str, ...],
                   computed_by: Callable[[str], Any], repeats: int) -> tuple[dict[str, list[float]], int]:
    """Seconds of `engine_25m`'s train steps in `dtype`, each way under `computed_by(way)`, the ways
    alternating call by call; and the batch's token count."""
    engine, batch = engine_25m(layout, dtype)

    def call(way: str) -> Callable[[], None]:
        def run() -> None:
            with computed_by(way):
                engine.train_step(batch, pg_loss, mini_batch_size=32)
        return run

    return alternating_times({way: call(way) for way in ways}, repeats), int(batch["attention_mask"].sum())


def train_step_times(layout: ParallelLayout, repeats: int) -> dict[str, Any]:
    times, tokens = step_times_25m(layout, "bf16", WAYS, computed_by, repeats)
    return {**summary(times), "seconds": times, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="calls of each way, alternating")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="of the kernel part")
    parser.add_argument("--skip-train-step", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/attention_bf16.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    in_world_of_one(lambda layout: run(args, layout))


def run(args: argparse.Namespace, layout: ParallelLayout) -> None:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    results: dict[str, Any] = {"machine": machine_info(), "load_before": load_average(), "threads": 1,
                               "dtype": args.dtype, "repeats": args.repeats, "kernel_ms": {}}
    print(f"LocalAttention forward + backward, {args.dtype}, {HEADS}/{GROUPS} heads of {HEAD_DIM}, "
          f"median ms (explicit / math / flash):")
    for rows, keys in SHAPES:
        r = kernel_times(rows, keys, dtype, args.repeats)
        results["kernel_ms"][f"{rows}x{keys}"] = r
        m = r["median"]
        print(f"  {rows:3d} rows x {keys:3d} keys: {m['explicit']:7.1f} / {m['math']:7.1f} / {m['flash']:7.1f}"
              f"   (math/explicit {r['ratio_to_explicit']['math']:.2f}, "
              f"flash/explicit {r['ratio_to_explicit']['flash']:.2f})")
    if not args.skip_train_step:
        r = train_step_times(layout, args.repeats)
        results["train_step_25m_bf16"] = r
        m = r["median"]
        print(f"25M bf16 train step, 32 rows of 68 tokens, median s: explicit {m['explicit']:.3f}, "
              f"math {m['math']:.3f}, flash {m['flash']:.3f} (pair ratios to explicit: math "
              f"{r['ratio_to_explicit']['math']:.3f}, flash {r['ratio_to_explicit']['flash']:.3f})")
    results["load_after"] = load_average()
    print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
