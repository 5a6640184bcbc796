"""Convert MATH-style data to megarl's parquet layout (verl's columns).

python tools/prepare_math.py --out data/math --local PATH   # a local copy (file or directory)
python tools/prepare_math.py --out data/math                # from the HF hub, when reachable
"""

import sys

from megarl.data.prepare import main

if __name__ == "__main__":
    sys.exit(main("math"))
