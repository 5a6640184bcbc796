"""torch.compile of the Megatron update on CPU: the ~25M e2e model's train step (forward, backward,
AdamW) with each transformer layer's forward compiled by Inductor, against the same step eager.

Two engines are built from the same weights; the compiled one gets `torch.compile` on every
`TransformerLayer.forward` (one graph per layer: the layers share their code, so Inductor compiles
one layer and reuses it). Per dtype (`--dtypes`) it records:

- first_steps_s: the compiled engine's first step (tracing and Inductor's C++ compile, into an empty
  Inductor cache, as on a fresh machine) and its second (a recompile, when one happens), against the
  eager engine's first two;
- median seconds of the train steps after those, the two engines alternating call by call so that
  load from other processes falls on both alike, and the median of the pair ratios compiled / eager;
- loss_abs_diff: |loss| of the two engines' first step (same weights and rows), a check that the
  compiled graph computes the same step.

One rank's batch of the e2e run: 32 rows of 4 prompt + 64 response tokens, one micro-batch. Runs in
this process as a world of 1 (gloo), one torch thread. Needs a C++ compiler (Inductor's CPU backend).

    python benchmarks/compile_update.py [--repeats 8] [--dynamic] [--out benchmarks/results/compile_update.json]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

from attention import engine_25m  # benchmarks/attention.py
from common import alternating_times, in_world_of_one, load_average, machine_info, write_json  # benchmarks/common.py
from engine import pg_loss  # benchmarks/engine.py
from local_modules import summary  # benchmarks/local_modules.py
from megarl.layout import ParallelLayout

DTYPES = ("fp32", "bf16")


def timed_step(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    start = time.perf_counter()
    metrics = engine.train_step(batch, pg_loss, mini_batch_size=32)
    return time.perf_counter() - start, float(metrics["loss"][0])


def compare(layout: ParallelLayout, dtype: str, repeats: int, dynamic: bool) -> dict[str, Any]:
    eager, batch = engine_25m(layout, dtype)
    compiled, _ = engine_25m(layout, dtype)
    for layer in compiled.model.decoder.layers:
        layer.forward = torch.compile(layer.forward, dynamic=dynamic)
    eager_first, eager_loss = timed_step(eager, batch)
    compiled_first, compiled_loss = timed_step(compiled, batch)
    compiled_second, _ = timed_step(compiled, batch)
    eager_second, _ = timed_step(eager, batch)
    times = alternating_times({"eager": lambda: timed_step(eager, batch),
                               "compiled": lambda: timed_step(compiled, batch)}, repeats)
    return {**summary(times), "seconds": times, "tokens": int(batch["attention_mask"].sum()),
            "first_steps_s": {"eager": [eager_first, eager_second], "compiled": [compiled_first, compiled_second]},
            "loss_abs_diff": abs(compiled_loss - eager_loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=8, help="timed calls of each engine, alternating")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated subset of {list(DTYPES)}")
    parser.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True): symbolic shapes, "
                        "as varying sequence lengths would need; default: static shapes")
    parser.add_argument("--out", default="benchmarks/results/compile_update.json")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise SystemExit(f"--dtypes: unknown {unknown}; valid: {list(DTYPES)}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="megarl_inductor_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read when Inductor first compiles: an empty cache
        in_world_of_one(lambda layout: run(args, dtypes, layout))


def run(args: argparse.Namespace, dtypes: list[str], layout: ParallelLayout) -> None:
    results: dict[str, Any] = {"machine": machine_info(), "load_before": load_average(), "threads": 1,
                               "repeats": args.repeats, "dynamic": args.dynamic, "torch": torch.__version__,
                               "train_step_25m_s": {}}
    for dtype in dtypes:
        r = compare(layout, dtype, args.repeats, args.dynamic)
        results["train_step_25m_s"][dtype] = r
        first = r["first_steps_s"]
        print(f"25M {dtype} train step, 32 rows of 68 tokens: eager {r['median']['eager']:.3f} s, compiled "
              f"{r['median']['compiled']:.3f} s (pair ratio {r['ratio_to_eager']['compiled']:.3f}); first two "
              f"steps compiled {first['compiled'][0]:.1f} + {first['compiled'][1]:.1f} s, eager "
              f"{first['eager'][0]:.1f} + {first['eager'][1]:.1f} s; |loss difference| {r['loss_abs_diff']:.2e}")
    results["load_after"] = load_average()
    print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
