"""A batch sampler whose position is part of the checkpoint, so a resumed run gets the next batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from megarl.errors import CheckpointError, ConfigError

# Keys of the state that must match between the checkpoint and the resumed run.
_LAYOUT_KEYS = ("num_rows", "batch_size", "shuffle", "seed", "drop_last")


class StatefulSampler:
    """Yields batches of row indices, epoch after epoch, from a position that can be saved.

    Epoch ``e`` visits the rows in the order ``default_rng([seed, e]).permutation(num_rows)``
    (``arange`` without shuffle), cut into batches of ``batch_size``; with ``drop_last`` the final
    short batch is skipped, otherwise it is yielded. The order of an epoch depends only on
    ``(seed, e)``, so the state is two integers: the epoch and the batches already handed out in it.
    """

    def __init__(
        self, num_rows: int, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            # numpy's default_rng takes non-negative integers only (and would fail at the first batch)
            raise ConfigError(f"seed (data.seed) must be an integer >= 0, got {seed!r}")
        if num_rows < (batch_size if drop_last else 1):
            raise ConfigError(
                f"a dataset of {num_rows} rows gives no batch of {batch_size}"
                + (" with drop_last" if drop_last else "")
            )
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches of `epoch` already handed out

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_rows, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The row order of ``epoch`` (int64, shape (num_rows,))."""
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows).astype(np.int64)

    def _roll_over_finished_epoch(self) -> None:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0

    def next_batch(self) -> tuple[int, np.ndarray]:
        """Hand out the next batch, moving into the next epoch when one is finished.

        Returns ``(epoch, indices)``; ``indices`` is int64 of shape (batch_size,) (shorter only for the
        last batch of an epoch without ``drop_last``).
        """
        self._roll_over_finished_epoch()
        order = self.epoch_order(self.epoch)
        start = self.position * self.batch_size
        self.position += 1
        return self.epoch, order[start : start + self.batch_size]

    def __iter__(self) -> Iterator[np.ndarray]:
        """The batches left in the current epoch (all of the next one when it is finished)."""
        self._roll_over_finished_epoch()
        epoch = self.epoch
        while self.epoch == epoch and self.position < self.batches_per_epoch:
            yield self.next_batch()[1]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, **{k: getattr(self, k) for k in _LAYOUT_KEYS}}

    def layout_differences(self, state: dict[str, Any]) -> list[str]:
        """The layout keys (rows, batch size, shuffle, seed, drop_last) that ``state`` lacks or holds
        with another value than this sampler: a state that cannot be continued here."""
        return [key for key in _LAYOUT_KEYS if key not in state or state[key] != getattr(self, key)]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the layout (rows, batch size, shuffle, seed, drop_last) must match."""
        for key in self.layout_differences(state):
            if key not in state:
                raise CheckpointError(f"sampler state has no '{key}' (keys: {sorted(state)})")
            raise CheckpointError(
                f"sampler state was saved with {key}={state[key]!r} "
                f"but this run has {key}={getattr(self, key)!r}; "
                "resuming would not continue the same sequence of batches"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.batches_per_epoch:
            raise CheckpointError(f"sampler state has epoch={epoch}, position={position}: out of range")
        self.epoch, self.position = epoch, position
