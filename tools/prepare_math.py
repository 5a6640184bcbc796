"""Convert MATH-style data to megarl's parquet layout (verl's columns).

python tools/prepare_math.py --out data/math --local DIR    # a local copy: a directory of the splits
python tools/prepare_math.py --out data/math --local FILE --splits test   # one file holds one split
python tools/prepare_math.py --out data/math                # from the HF hub, when reachable
"""

import sys

from megarl.data.prepare import main

if __name__ == "__main__":
    sys.exit(main("math"))
