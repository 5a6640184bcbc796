"""Cost of checkpoint verification against the cost of writing the checkpoint.

A random Qwen2-shaped model (the sizes of benchmarks/reshard.py, float32) is converted to a Megatron
checkpoint (`convert hf-to-mcore`, timed as the write), committed as a checkpoint directory by
`CheckpointDirs` (which records each file's size and CRC-32: timed against a commit without
fsync), then checked with `verify_checkpoint`: the structural check (index, shard lengths, every
tensor of the model spec) and the CRC-32 pass over every byte.

    python benchmarks/checkpoint_verify.py [--size 100M] [--out benchmarks/results/checkpoint_verify.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from reshard import SIZES, hf_config  # noqa: E402

from megarl.convert.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from megarl.trainer.checkpoint_dirs import CheckpointDirs, crc32_of_file  # noqa: E402
from megarl.trainer.checkpoint_verify import verify_engine_checkpoint  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "checkpoint_verify.json"


def run(size: str, work: Path) -> dict[str, Any]:
    import transformers

    config = transformers.Qwen2Config(**{k: v for k, v in hf_config(size).items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    hf_dir = work / "hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    del model

    t0 = time.perf_counter()
    convert_hf_to_mcore(hf_dir, work / "mcore", progress=False)
    write_seconds = time.perf_counter() - t0

    dirs = CheckpointDirs(work / "checkpoints")
    tmp = dirs.begin(1)
    shutil.copytree(work / "mcore", tmp / "actor")
    t0 = time.perf_counter()
    step_dir = dirs.commit(tmp, 1, fsync_files=False)
    commit_seconds = time.perf_counter() - t0
    files = [p for p in (step_dir / "actor").iterdir() if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    t0 = time.perf_counter()
    for p in files:
        crc32_of_file(p)
    crc_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    report = verify_engine_checkpoint(step_dir / "actor", hf_config=hf_dir)
    structural_seconds = time.perf_counter() - t0
    assert report.ok, report.message()
    row = dict(size=size, params=params, checkpoint_bytes=nbytes, write_seconds=write_seconds,
               commit_seconds=commit_seconds, crc_seconds=crc_seconds, crc_gb_per_s=nbytes / crc_seconds / 1e9,
               structural_verify_seconds=structural_seconds,
               verify_over_write=(crc_seconds + structural_seconds) / write_seconds)
    print(f"{size}: {params / 1e6:.0f}M parameters, checkpoint {nbytes / 2**20:.0f} MiB written in {write_seconds:.2f} s; "
          f"commit (manifest with CRC-32) {commit_seconds:.2f} s; CRC-32 pass {crc_seconds:.2f} s "
          f"({row['crc_gb_per_s']:.1f} GB/s); structural check {structural_seconds:.2f} s; "
          f"verification / write = {row['verify_over_write']:.2f}")
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100M", help=f"one of {','.join(SIZES)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results path")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="megarl_ckpt_verify_") as work:
        row = run(args.size, Path(work))
    results = dict(benchmark="checkpoint_verify", torch=torch.__version__, platform=platform.platform(),
                   cpus=os.cpu_count(), results=[row])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
