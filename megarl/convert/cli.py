"""``megarl convert hf-to-mcore`` and ``megarl convert mcore-to-hf`` (also tools/convert_checkpoint.py)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from megarl.argtypes import positive_int
from megarl.convert.output_dir import check_not_overlapping
from megarl.errors import MegarlError

_parallel_size = positive_int("parallel size")

if TYPE_CHECKING:  # the conversions import torch: loaded only when a subcommand runs
    from megarl.convert.hf_to_mcore import ConversionResult

EXAMPLES = """examples:
  megarl convert hf-to-mcore --hf models/Qwen2.5-0.5B --out ckpt/qwen_mcore --tp 2 --pp 1
  megarl convert mcore-to-hf --ckpt runs/exp/checkpoints/global_step_100/actor --out exported/actor
"""


def _size(text: str) -> int:
    """'2GB', '500MB', '1GiB' or a number of bytes (argparse type: a bad size is a usage error)."""
    units = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    low = text.strip().lower()
    unit = next((u for u in sorted(units, key=len, reverse=True) if low.endswith(u)), "")
    try:
        value = int(float(low[: len(low) - len(unit)]) * units.get(unit, 1))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; valid: a number of bytes >= 1, or one with a unit "
                                         "(KB, MB, GB, KiB, MiB, GiB), e.g. 2GiB, 500MB")
    return value


def _hf_to_mcore(args: argparse.Namespace) -> int:
    from megarl.convert.hf_to_mcore import convert_hf_to_mcore

    if args.overwrite:  # without it an existing --out is refused anyway
        check_not_overlapping(args.out, args.hf, "--hf")

    res = convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                              overwrite=args.overwrite, progress=not args.quiet, family=args.spec)
    _report(res)
    return 0


def _report(res: ConversionResult) -> None:
    print(f"wrote {res.out_dir} ({res.num_tensors} HF tensors, {res.num_bytes / 2**20:.1f} MiB) in {res.seconds:.1f} s")
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)


def _mcore_to_hf(args: argparse.Namespace) -> int:
    from megarl.convert.mcore_to_hf import convert_mcore_to_hf

    if args.overwrite:  # without it an existing --out is refused anyway
        check_not_overlapping(args.out, args.ckpt, "--ckpt")
        if args.hf_config is not None:
            check_not_overlapping(args.out, args.hf_config, "--hf-config")

    res = convert_mcore_to_hf(args.ckpt, args.out, hf_config=args.hf_config, dtype=args.dtype,
                              max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                              progress=not args.quiet)
    _report(res)
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """Add `convert` with its two subcommands to the `megarl` command line."""
    parser = subparsers.add_parser(
        "convert", help="convert checkpoints between HF and Megatron formats",
        description="Convert checkpoints between HF safetensors and Megatron distributed checkpoints, "
                    "streaming tensor by tensor.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_subcommands(parser)


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="convert_command", required=True, metavar="{hf-to-mcore,mcore-to-hf}")
    p = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint (loads at any TP/PP)")
    p.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    p.add_argument("--tp", type=_parallel_size, default=1, help="tensor-parallel size to check and pad the vocabulary for")
    p.add_argument("--pp", type=_parallel_size, default=1, help="pipeline-parallel size to check")
    p.add_argument("--ep", type=_parallel_size, default=1, help="expert-parallel size (MoE families only)")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: keep the HF dtype)")
    p.add_argument("--spec", default=None, metavar="FAMILY",
                   help="model spec family (a model_specs/ file name, as model.spec) for a config whose model_type "
                        "no family lists; recorded in the checkpoint (default: the family listing the model_type)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_hf_to_mcore)

    p = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint (converted or trainer's) -> HF safetensors")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (e.g. <run>/checkpoints/global_step_N/actor)")
    p.add_argument("--out", required=True, help="output HF model directory (must not exist)")
    p.add_argument("--hf-config", default=None,
                   help="HF directory with config.json and tokenizer (default: the checkpoint's own copy, the "
                        "HF directory the trainer built the model from, or <run_dir>/initial_model)")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: keep the checkpoint's dtype)")
    p.add_argument("--max-shard-size", type=_size, default="2GiB", help="largest safetensors file, e.g. 2GiB, 500MB")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_mcore_to_hf)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`convert ...` on its own (used by tools/convert_checkpoint.py)."""
    parser = argparse.ArgumentParser(prog="convert_checkpoint", epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MegarlError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
