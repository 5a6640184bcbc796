"""The random streams of a seeded generation: one per response row of the whole batch.

A call seeded with `SamplingParams.seed` samples response row r of the whole batch (the c-th
sample of prompt p is row p * n + c, prompts counted over every data-parallel rank from
`SamplingParams.row_offset`) from the stream of seed ``row_seed(seed, r)`` = a hash of the call's
seed, plus r. So

- the rows of one call never share a stream (consecutive seeds, distinct even in the 32 low bits
  that torch's CPU generator keeps), whichever engine or rank samples them;
- a batch samples the same rows whatever its split over ranks (a row's stream depends on its
  index in the batch, not on the rank that holds it);
- calls whose seeds differ (another step, DAPO attempt, validation, chunk of a partial rollout,
  turn of an agent loop: seeds that often differ by small numbers) start their rows at
  unrelated points of a 2^62 space: their streams coincide with probability ~rows / 2^62.

vLLM is handed the seed of each request's first row and seeds its n samples seed, seed + 1, ...
(its own convention, which this layout follows). The HF engine draws one uniform per row and
token from `row_uniforms`, a SplitMix64 stream keyed by the row's seed: a counter-based generator
computed for all rows at once, so per-row streams cost no Python loop over rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SEED_SPACE = 2**62  # row seeds live in [0, 2^62): seed + (n - 1) still fits an int64 (vLLM adds the sample index)
_MASK64 = 2**64 - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (odd: the counter visits every 64-bit value)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    return int(_mix64_array(np.array([int(x) & _MASK64], dtype=np.uint64))[0])


def call_base(seed: int) -> int:
    """The seed of row 0 of a call seeded `seed` (a hash of it, in [0, SEED_SPACE))."""
    return mix64(mix64(int(seed)) + _GAMMA) % SEED_SPACE


def row_seed(seed: int, row: int) -> int:
    """The seed of response row `row` (of the whole batch) of a call seeded `seed`."""
    return (call_base(seed) + int(row)) % SEED_SPACE


def row_seeds(seed: int, rows: Sequence[int] | np.ndarray) -> np.ndarray:
    """(len(rows),) uint64: `row_seed(seed, r)` for each response row r of the whole batch."""
    base = np.uint64(call_base(seed))
    return (base + np.asarray(rows, dtype=np.uint64)) % np.uint64(SEED_SPACE)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """`mix64` over a uint64 array (numpy's unsigned arithmetic wraps modulo 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def row_uniforms(seeds: np.ndarray, start: int, count: int) -> np.ndarray:
    """(rows, count) float64 uniforms in [0, 1): draws start .. start + count - 1 of each row's stream.

    Row i's stream is SplitMix64 started at `mix64(seeds[i])`: draw t is
    ``mix64(mix64(seeds[i]) + (t + 1) * GAMMA)`` (top 53 bits). Any draw can be computed alone, so
    a decode takes them in chunks of steps and two calls with the same seeds see the same numbers.
    """
    with np.errstate(over="ignore"):
        state = _mix64_array(np.asarray(seeds, dtype=np.uint64))
        counters = np.arange(start + 1, start + count + 1, dtype=np.uint64) * np.uint64(_GAMMA)
        draws = _mix64_array(state[:, None] + counters[None, :])
    return (draws >> np.uint64(11)).astype(np.float64) * 2.0**-53
