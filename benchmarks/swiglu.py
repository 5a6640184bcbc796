"""The local spec's SwiGLU (`megarl.megatron.mlp.swiglu`, one autograd node) against Megatron's own.

`LocalMLP` computes silu(gate) * up with `swiglu`; Megatron's unfused path (what the local spec ran
before) chunks fc1's output, adds the GLU offset (0) to `up`, and its backward concatenates the two
halves' gradients. Both give the same bits (tests/unit/megatron/test_mlp.py). Two parts, each
alternating the two call by call, so that load from other processes falls on both alike:

- activation: forward + backward of the activation alone on one rank's fc1 output of the ~25M e2e
  model (68 positions x 32 rows x 2*1536), fp32 and bf16; median ms and the median pair ratio.
- train_step: one Megatron engine train step (forward, backward, AdamW) of that model, 32 rows of
  4 prompt + 64 response tokens, fp32 and bf16; median seconds and the median pair ratio.

Runs in this process as a world of 1 (gloo), one torch thread.

    python benchmarks/swiglu.py [--repeats 10] [--out benchmarks/results/swiglu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

import megarl.megatron.mlp as mlp
from attention import engine_25m  # benchmarks/attention.py
from common import alternating_times, in_world_of_one, load_average, machine_info, write_json  # benchmarks/common.py
from engine import pg_loss
from megarl.layout import ParallelLayout

WAYS = ("swiglu", "megatron")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@contextlib.contextmanager
def computed_by(way: str) -> Iterator[None]:
    """Within the block `LocalMLP` computes its activation `way`: with `swiglu` (as it does) or
    Megatron's unfused gated path (the parent class's forward)."""
    applies = mlp.swiglu_applies
    if way == "megatron":
        mlp.swiglu_applies = lambda config: False
    try:
        yield
    finally:
        mlp.swiglu_applies = applies


def megatron_glu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused gated activation at SiLU, no clamp, offset 0 (MLP.forward's `glu`)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * (up + 0.0)


def summary(times: dict[str, list[float]], scale: float = 1.0) -> dict[str, Any]:
    """Median of each way (times `scale`) and the median of Megatron's pair ratio to `swiglu`."""
    return {"median": {way: statistics.median(t) * scale for way, t in times.items()},
            "megatron_over_swiglu": statistics.median(a / b for a, b in zip(times["megatron"], times["swiglu"]))}


def activation_times(dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(68, 32, 2 * 1536, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(68, 32, 1536, generator=g).to(dtype)
    fns = {"swiglu": mlp.swiglu, "megatron": megatron_glu}

    def call(way: str) -> Callable[[], None]:
        def run() -> None:
            fns[way](x).backward(grad)
            x.grad = None
        return run

    return summary(alternating_times({way: call(way) for way in WAYS}, repeats), scale=1e3)


def train_step_times(layout: ParallelLayout, dtype: str, repeats: int) -> dict[str, Any]:
    engine, batch = engine_25m(layout, dtype)

    def call(way: str) -> Callable[[], None]:
        def run() -> None:
            with computed_by(way):
                engine.train_step(batch, pg_loss, mini_batch_size=32)
        return run

    times = alternating_times({way: call(way) for way in WAYS}, repeats)
    return {**summary(times), "seconds": times, "tokens": int(batch["attention_mask"].sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="calls of each way, alternating")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated subset of {list(DTYPES)}")
    parser.add_argument("--skip-train-step", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/swiglu.json")
    args = parser.parse_args()
    in_world_of_one(lambda layout: run(args, layout))


def run(args: argparse.Namespace, layout: ParallelLayout) -> None:
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise SystemExit(f"--dtypes: unknown {unknown}; valid: {list(DTYPES)}")
    results: dict[str, Any] = {"machine": machine_info(), "load_before": load_average(), "threads": 1,
                               "repeats": args.repeats, "activation_ms": {}, "train_step_25m_s": {}}
    for name in dtypes:
        dtype = DTYPES[name]
        r = activation_times(dtype, args.repeats)
        results["activation_ms"][name] = r
        print(f"SwiGLU forward + backward, 68x32x{2 * 1536} {name}: swiglu {r['median']['swiglu']:.1f} ms, "
              f"Megatron's {r['median']['megatron']:.1f} ms (pair ratio {r['megatron_over_swiglu']:.2f})")
    if not args.skip_train_step:
        for name in dtypes:
            r = train_step_times(layout, name, args.repeats)
            results["train_step_25m_s"][name] = r
            print(f"25M {name} train step, 32 rows of 68 tokens: swiglu {r['median']['swiglu']:.3f} s, "
                  f"Megatron's {r['median']['megatron']:.3f} s (pair ratio {r['megatron_over_swiglu']:.3f})")
    results["load_after"] = load_average()
    print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
