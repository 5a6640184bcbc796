#!/usr/bin/env python
"""Convert checkpoints between HF safetensors and Megatron distributed checkpoints.

Same as `megarl convert ...`:
  python tools/convert_checkpoint.py hf-to-mcore --hf HF_DIR --out CKPT_DIR --tp 2 --pp 1
  python tools/convert_checkpoint.py mcore-to-hf --ckpt CKPT_DIR --out HF_DIR [--hf-config HF_DIR]
"""

from __future__ import annotations

import sys

from megarl.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
