"""The end-to-end comparison with TRL (benchmarks/e2e.py) at the ~25M size: hidden 512, 8 layers,
up to 64 response tokens, with the useful-token MFU of the update and log-prob phases.

    python benchmarks/e2e_25m.py [--steps 8] [--quick] [--out benchmarks/results/e2e_25m.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["--size", "25m", *sys.argv[1:]]))
