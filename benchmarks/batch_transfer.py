"""How fast a step's `Batch` travels between the driver and a Ray worker, by the encoding of its
tensor columns, side by side in one run:

  torch   every column pickled as a torch tensor (torch's storage pickler, how `Batch` was
          pickled before), wrapped in a plain dict with the batch's object columns
  batch   `Batch` as it pickles now (host columns as numpy arrays, their buffers out of band)

For each: pickle dumps, pickle loads, `ray.put` + `ray.get` in the driver, and a round trip to a
Ray actor that receives the batch and sends it back (what `call_dp` does for a rollout or an
update, per DP rank). The batch is the quickstart's update batch for one DP rank (32 rows of
8 prompt + 4 response tokens, the columns a GRPO step sends); `--rows`, `--prompt`, `--response`
change it. Times are medians of `--repeats` calls after a warm-up, in milliseconds.

    python benchmarks/batch_transfer.py                # under a minute on 2 CPU cores

Prints a table and writes JSON to --out (default benchmarks/results/batch_transfer.json).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS_DIR, machine_info, ratio, write_json  # noqa: E402

from megarl.protocol import Batch  # noqa: E402

# The tensor columns of a GRPO update batch (per row: prompt P, response R, total T = P + R).
COLUMNS = {
    "prompts": ("P", torch.int64), "responses": ("R", torch.int64), "input_ids": ("T", torch.int64),
    "attention_mask": ("T", torch.int64), "position_ids": ("T", torch.int64), "response_mask": ("R", torch.float32),
    "rollout_log_probs": ("R", torch.float32), "token_level_scores": ("R", torch.float32),
    "token_level_rewards": ("R", torch.float32), "advantages": ("R", torch.float32), "returns": ("R", torch.float32),
    "rollout_weights_version": ("", torch.int64),
}


def step_batch(rows: int, prompt: int, response: int) -> Batch:
    widths = {"P": prompt, "R": response, "T": prompt + response}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (width, dtype) in COLUMNS.items():
        shape = (rows, widths[width]) if width else (rows,)
        values = torch.randn(shape, generator=generator)
        tensors[name] = values if dtype.is_floating_point else (values.abs() * 10).to(dtype)
    non_tensors = {"uid": np.array([f"uid-{r // 8}" for r in range(rows)], dtype=object),
                   "data_source": np.array(["arithmetic"] * rows, dtype=object),
                   "ground_truth": np.array([str(r % 9) for r in range(rows)], dtype=object)}
    return Batch.from_dict(tensors, non_tensors, {"global_step": 1})


def torch_encoded(batch: Batch) -> dict[str, Any]:
    """The same columns as a plain dict of torch tensors and object arrays."""
    return {"tensors": {key: batch[key] for key in batch.tensor_keys},
            "non_tensors": {key: batch[key] for key in batch.non_tensor_keys}, "meta": dict(batch.meta)}


@ray.remote(num_cpus=0)
class Echo:
    def back(self, value: Any) -> Any:
        return value


def median_ms(call: Callable[[], Any], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(value: Any, echo: Any, repeats: int) -> dict[str, float]:
    data = pickle.dumps(value, protocol=5)
    ref = ray.put(value)
    return {
        "bytes": len(data),
        "dumps_ms": median_ms(lambda: pickle.dumps(value, protocol=5), repeats),
        "loads_ms": median_ms(lambda: pickle.loads(data), repeats),
        "put_get_ms": median_ms(lambda: ray.get(ray.put(value)), repeats),
        "get_ms": median_ms(lambda: ray.get(ref), repeats),
        "actor_round_trip_ms": median_ms(lambda: ray.get(echo.back.remote(value)), repeats),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--response", type=int, default=4)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "batch_transfer.json")
    args = p.parse_args(argv)

    batch = step_batch(args.rows, args.prompt, args.response)
    as_batch, as_torch = pickle.loads(pickle.dumps(batch)), pickle.loads(pickle.dumps(torch_encoded(batch)))
    for key in batch.tensor_keys:  # the encodings carry the same data
        assert torch.equal(as_batch[key], as_torch["tensors"][key])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        echo = Echo.remote()
        results = {"torch": measure(torch_encoded(batch), echo, args.repeats), "batch": measure(batch, echo, args.repeats)}
    finally:
        ray.shutdown()
    speedup = {key: ratio(results["torch"][key], results["batch"][key])
               for key in results["batch"] if key.endswith("_ms")}
    print(f"{'encoding':8} " + " ".join(f"{k:>20}" for k in results["batch"]))
    for name, row in results.items():
        print(f"{name:8} " + " ".join(f"{v:20.3f}" if isinstance(v, float) else f"{v:20d}" for v in row.values()))
    print("torch / batch: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedup.items()))
    payload = {"section": "batch_transfer", "machine": machine_info(),
               "setup": {"rows": args.rows, "prompt_tokens": args.prompt, "response_tokens": args.response,
                         "tensor_columns": len(COLUMNS), "repeats": args.repeats, "times": "median, milliseconds"},
               "results": results, "speedup_torch_over_batch": speedup}
    write_json(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
