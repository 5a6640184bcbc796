"""Checkpoint conversion: streaming converter vs a plain load-all-then-save, time and peak memory.

A random Qwen2-shaped model (default: hidden 1024, 12 layers, vocab 32000, untied, bf16, about
375 MB in two safetensors shards with an index) is converted HF -> Megatron (torch_dist) by
  - streaming: `megarl.convert.convert_hf_to_mcore` (one layer's parameter in memory at a time);
  - load-all: every HF tensor read, every Megatron tensor built and stacked, then one DCP save
    (what a converter without streaming does);
and back Megatron -> HF by the streaming converter. Each run is a fresh subprocess, so peak RSS
(`ru_maxrss`) is its own; "peak over base" subtracts the RSS after imports. Both checkpoints are
compared tensor by tensor (they must be equal).

    python benchmarks/convert.py [--hidden 1024] [--layers 12] [--vocab 32000] [--out benchmarks/results/convert.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "convert.json"
BACK_SHARD_BYTES = 100 * 2**20  # HF shards written back: the converter holds one shard in memory


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def make_model_dir(path: Path, hidden: int, layers: int, vocab: int) -> dict[str, Any]:
    """Random bf16 Qwen2 weights with transformers' names and shapes, in two shards + index."""
    import torch
    from safetensors.torch import save_file

    from megarl.convert.hf_files import expected_hf_shapes

    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    config = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu", hidden_size=hidden,
                  intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16")
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    shapes = expected_hf_shapes(config)
    gen = torch.Generator().manual_seed(0)
    names = sorted(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, total = {}, 0
    largest = max(torch.Size(s).numel() for s in shapes.values()) * 2
    for i, part in enumerate(halves):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=gen).to(torch.bfloat16) for n in part}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({n: fname for n in part})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return {"config": config, "bytes": total, "largest_tensor_bytes": largest}


# ---------------------------------------------------------------- the measured runs (subprocesses)
def run_streaming(hf_dir: str, out: str) -> dict[str, float]:
    from megarl.convert.hf_to_mcore import convert_hf_to_mcore

    base = _rss_mib()
    start = time.perf_counter()
    convert_hf_to_mcore(hf_dir, out, progress=False)
    return {"seconds": time.perf_counter() - start, "base_rss_mib": base}


def run_load_all(hf_dir: str, out: str) -> dict[str, float]:
    import torch
    import torch.distributed.checkpoint as dcp

    from megarl.convert.dcp_io import MEGATRON_METADATA
    from megarl.convert.layout import plan_checkpoint
    from megarl.models.spec import ModelSpec
    from megarl.models.weight_map import hf_to_megatron_state_dict, read_hf_tensors

    base = _rss_mib()
    start = time.perf_counter()
    index = json.loads((Path(hf_dir) / "model.safetensors.index.json").read_text())["weight_map"]
    hf_sd = read_hf_tensors(hf_dir, index)  # everything in memory
    spec = ModelSpec.from_hf_config(hf_dir)
    local = hf_to_megatron_state_dict(hf_sd, spec, 0, 1, 0, 1)
    shapes = {n: tuple(t.shape) for n, t in hf_sd.items()}
    state = {}
    for t in plan_checkpoint(spec, "policy", shapes, tp=1):
        if t.stacked:
            state[t.key] = torch.stack([local[t.entry.megatron.format(layer=i)] for i in range(len(t.hf_names))])
        else:
            state[t.key] = local[t.entry.megatron]
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out, thread_count=1, sync_files=False), no_dist=True)
    torch.save({}, Path(out) / "common.pt")
    (Path(out) / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    return {"seconds": time.perf_counter() - start, "base_rss_mib": base}


def run_back(ckpt: str, out: str) -> dict[str, float]:
    from megarl.convert.mcore_to_hf import convert_mcore_to_hf

    base = _rss_mib()
    start = time.perf_counter()
    convert_mcore_to_hf(ckpt, out, max_shard_bytes=BACK_SHARD_BYTES, progress=False)
    return {"seconds": time.perf_counter() - start, "base_rss_mib": base}


def run_compare(a: str, b: str) -> dict[str, float]:
    import torch

    from megarl.convert.dcp_io import CheckpointReader

    ra, rb = CheckpointReader(a), CheckpointReader(b)
    keys = sorted(ra.metadata.state_dict_metadata)
    assert keys == sorted(rb.metadata.state_dict_metadata), "checkpoints hold different keys"
    for k in keys:
        assert torch.equal(ra.read(k), rb.read(k)), f"{k} differs"
    return {"keys": len(keys)}


RUNS = {"streaming": run_streaming, "load_all": run_load_all, "back": run_back, "compare": run_compare}


def _child(name: str, a: str, b: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core  # noqa: F401  (imports are counted in the base RSS of every run alike)
    import torch  # noqa: F401
    import transformers

    # The streaming converter checks HF shapes against transformers' model class: its import
    # (seconds) is paid once per process and is not conversion work.
    transformers.Qwen2ForCausalLM  # noqa: B018

    result = RUNS[name](a, b)
    result["peak_rss_mib"] = _peak_mib()
    print("RESULT " + json.dumps(result))


def measure(name: str, a: str, b: str) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, __file__, "--child", name, a, b], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="megarl_convert_bench_") as tmp:
        work = Path(tmp)
        model = make_model_dir(work / "hf", args.hidden, args.layers, args.vocab)
        mib = model["bytes"] / 2**20
        largest = model["largest_tensor_bytes"] / 2**20
        print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, bf16, {mib:.0f} MiB "
              f"(largest tensor {largest:.1f} MiB)")
        results = {
            "streaming": measure("streaming", str(work / "hf"), str(work / "stream")),
            "load_all": measure("load_all", str(work / "hf"), str(work / "all")),
        }
        results["mcore_to_hf_streaming"] = measure("back", str(work / "stream"), str(work / "back"))
        compared = measure("compare", str(work / "stream"), str(work / "all"))
    for r in results.values():
        r["peak_over_base_mib"] = r["peak_rss_mib"] - r["base_rss_mib"]
    s, a = results["streaming"], results["load_all"]
    print(f"{'run':<24}{'seconds':>10}{'peak RSS MiB':>14}{'over base MiB':>15}")
    for name, r in results.items():
        print(f"{name:<24}{r['seconds']:>10.2f}{r['peak_rss_mib']:>14.0f}{r['peak_over_base_mib']:>15.0f}")
    print(f"streaming / load-all: time {s['seconds'] / a['seconds']:.2f}x, "
          f"peak over base {s['peak_over_base_mib'] / a['peak_over_base_mib']:.2f}x "
          f"(model {mib:.0f} MiB); checkpoints equal ({compared['keys']} keys)")
    report = {
        "benchmark": "convert", "model": {k: model["config"][k] for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size")},
        "model_mib": mib, "largest_tensor_mib": largest, "back_shard_mib": BACK_SHARD_BYTES / 2**20,
        "results": results, "checkpoints_equal_keys": compared["keys"],
        "ratio_time_streaming_over_load_all": s["seconds"] / a["seconds"],
        "ratio_peak_over_base_streaming_over_load_all": s["peak_over_base_mib"] / a["peak_over_base_mib"],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
