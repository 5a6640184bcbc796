"""The local spec's own modules against what they replace: SwiGLU (`megarl.megatron.mlp.swiglu`,
one autograd node, in `LocalMLP`) against Megatron's unfused gated activation, and RMSNorm
(`megarl.megatron.norm.rms_norm`, a closed-form backward, in `LocalRMSNorm`) against torch's
`rms_norm`. Each gives the same forward bits as what it replaces (tests/unit/megatron/test_mlp.py,
test_norm.py). Three parts, each alternating its ways call by call, so that load from other
processes falls on all of them alike:

- swiglu: forward + backward of the activation alone on one rank's fc1 output of the ~25M e2e
  model (68 positions x 32 rows x 2*1536), `swiglu` and Megatron's; median ms and the pair ratio.
- rms_norm: forward + backward of one norm on that rank's hidden states (68 x 32 x 512), `rms_norm`
  and torch's; median ms and the pair ratio.
- train_step: one Megatron engine train step (forward, backward, AdamW) of that model, 32 rows of
  4 prompt + 64 response tokens: as built (`local`), with Megatron's SwiGLU (`megatron_swiglu`), with
  torch's RMSNorm (`torch_rms_norm`), and with both (`neither`: the model before these modules);
  median seconds and each one's pair ratio to `local`.

All in fp32 and bf16 (`--dtypes`). Runs in this process as a world of 1 (gloo), one torch thread.

    python benchmarks/local_modules.py [--repeats 10] [--out benchmarks/results/local_modules.json]
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
import megarl.megatron.norm as norm
from attention import step_times_25m  # benchmarks/attention.py
from common import alternating_times, in_world_of_one, load_average, machine_info, write_json  # benchmarks/common.py
from megarl.layout import ParallelLayout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEP_WAYS = ("local", "megatron_swiglu", "torch_rms_norm", "neither")


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    return F.rms_norm(x, [x.shape[-1]], weight, eps)


def megatron_swiglu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused gated activation at SiLU, no clamp, offset 0 (MLP.forward's `glu`)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * (up + 0.0)


@contextlib.contextmanager
def computed_by(way: str) -> Iterator[None]:
    """Within the block the engine's model computes as built (`local`), or with one module back to
    what it replaced: Megatron's SwiGLU path (`LocalMLP` defers to its parent class) or torch's
    `rms_norm` (with torch's autograd), or with both (`neither`)."""
    applies, rms = mlp.swiglu_applies, norm.rms_norm
    if way in ("megatron_swiglu", "neither"):
        mlp.swiglu_applies = lambda config: False
    if way in ("torch_rms_norm", "neither"):
        norm.rms_norm = torch_rms_norm
    try:
        yield
    finally:
        mlp.swiglu_applies, norm.rms_norm = applies, rms


def summary(times: dict[str, list[float]], scale: float = 1.0) -> dict[str, Any]:
    """Median of each way (times `scale`), and each other way's median pair ratio to the first."""
    base_name, *others = times
    base = times[base_name]
    return {"median": {way: statistics.median(t) * scale for way, t in times.items()},
            f"ratio_to_{base_name}": {way: statistics.median(a / b for a, b in zip(times[way], base))
                                      for way in others}}


def forward_backward_times(fns: dict[str, Callable[..., torch.Tensor]], shape: tuple[int, ...],
                           dtype: torch.dtype, repeats: int, with_weight: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    weight = (1.0 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).requires_grad_()
    out_shape = (*shape[:-1], shape[-1] if with_weight else shape[-1] // 2)
    grad = torch.randn(out_shape, generator=g).to(dtype)

    def call(fn: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            (fn(x, weight, 1e-6) if with_weight else fn(x)).backward(grad)
            x.grad = weight.grad = None
        return run

    return summary(alternating_times({name: call(fn) for name, fn in fns.items()}, repeats), scale=1e3)


def train_step_times(layout: ParallelLayout, dtype: str, repeats: int) -> dict[str, Any]:
    times, tokens = step_times_25m(layout, dtype, STEP_WAYS, computed_by, repeats)
    return {**summary(times), "seconds": times, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="calls of each way, alternating")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated subset of {list(DTYPES)}")
    parser.add_argument("--skip-train-step", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/local_modules.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    in_world_of_one(lambda layout: run(args, layout))


def run(args: argparse.Namespace, layout: ParallelLayout) -> None:
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise SystemExit(f"--dtypes: unknown {unknown}; valid: {list(DTYPES)}")
    results: dict[str, Any] = {"machine": machine_info(), "load_before": load_average(), "threads": 1,
                               "repeats": args.repeats, "swiglu_ms": {}, "rms_norm_ms": {}, "train_step_25m_s": {}}
    for name in dtypes:
        r = forward_backward_times({"swiglu": mlp.swiglu, "megatron": megatron_swiglu}, (68, 32, 2 * 1536),
                                   DTYPES[name], args.repeats)
        results["swiglu_ms"][name] = r
        print(f"SwiGLU forward + backward, 68x32x{2 * 1536} {name}: swiglu {r['median']['swiglu']:.1f} ms, "
              f"Megatron's {r['median']['megatron']:.1f} ms (pair ratio {r['ratio_to_swiglu']['megatron']:.2f})")
        r = forward_backward_times({"rms_norm": norm.rms_norm, "torch": torch_rms_norm}, (68, 32, 512),
                                   DTYPES[name], args.repeats, with_weight=True)
        results["rms_norm_ms"][name] = r
        print(f"RMSNorm forward + backward, 68x32x512 {name}: rms_norm {r['median']['rms_norm']:.1f} ms, "
              f"torch's {r['median']['torch']:.1f} ms (pair ratio {r['ratio_to_rms_norm']['torch']:.2f})")
    if not args.skip_train_step:
        for name in dtypes:
            r = train_step_times(layout, name, args.repeats)
            results["train_step_25m_s"][name] = r
            ratios = ", ".join(f"{way} {ratio:.3f}" for way, ratio in r["ratio_to_local"].items())
            print(f"25M {name} train step, 32 rows of 68 tokens: local {r['median']['local']:.3f} s "
                  f"(pair ratios to it: {ratios})")
    results["load_after"] = load_average()
    print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
