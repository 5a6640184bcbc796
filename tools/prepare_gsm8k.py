"""Convert GSM8K to megarl's parquet layout (verl's columns).

python tools/prepare_gsm8k.py --out data/gsm8k --local DIR    # a local copy: a directory of the splits
python tools/prepare_gsm8k.py --out data/gsm8k --local FILE --splits test   # one file holds one split
python tools/prepare_gsm8k.py --out data/gsm8k                # from the HF hub, when reachable
python tools/prepare_gsm8k.py --out data/gsm8k_tools --local PATH --tools code_interpreter
    # multi-turn rows: a system message describing the tool (Hermes <tool_call> format) and
    # extra_info.tools_kwargs (verl's layout)
"""

import sys

from megarl.data.prepare import main

if __name__ == "__main__":
    sys.exit(main("gsm8k"))
