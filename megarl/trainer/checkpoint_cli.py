"""`megarl checkpoint verify DIR`: is a checkpoint complete (see `megarl.trainer.checkpoint_verify`)?"""

from __future__ import annotations

import argparse
import sys

EXAMPLES = """examples:
  megarl checkpoint verify runs/exp/checkpoints                 the checkpoint the tracker file names
  megarl checkpoint verify runs/exp/checkpoints/global_step_40  one trainer checkpoint
  megarl checkpoint verify ckpt/qwen_mcore                       a converted Megatron checkpoint
  megarl checkpoint verify exported/actor                        a HF model directory
"""


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "checkpoint", help="verify that a checkpoint is complete",
        description="Check trainer, Megatron and HF checkpoints for completeness.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="checkpoint_command", required=True, metavar="{verify}")
    p = sub.add_parser("verify", help="exit 1 naming every missing or damaged tensor and file")
    p.add_argument("dir", help="trainer checkpoint (global_step_N), checkpoint root, Megatron or HF checkpoint")
    p.add_argument("--hf-config", default=None,
                   help="HF directory with config.json, for a Megatron checkpoint that carries none")
    p.add_argument("--no-checksums", action="store_true",
                   help="check file sizes against the save's manifest, not their CRC-32 (faster)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print what was checked when the check fails too (it is printed whenever it passes)")
    p.set_defaults(func=_verify)


def _verify(args: argparse.Namespace) -> int:
    # Imported here: the other `megarl` commands start without torch and Megatron.
    from megarl.trainer.checkpoint_verify import verify_checkpoint

    report = verify_checkpoint(args.dir, checksums=not args.no_checksums, hf_config=args.hf_config)
    if args.verbose or report.ok:
        for note in report.notes:
            print(note)
    print(report.message(), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1
