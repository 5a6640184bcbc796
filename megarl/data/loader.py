"""Batches of prompts from an RLDataset in a resumable order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from megarl.data.dataset import RLDataset
from megarl.data.sampler import StatefulSampler
from megarl.protocol.batch import Batch


class RLDataLoader:
    """Iterates an :class:`RLDataset` in batches of ``batch_size`` prompts.

    ``for batch in loader`` yields the batches left in the current epoch (a whole epoch when the
    previous one is finished); :meth:`next_batch` crosses epochs. ``state_dict`` after k batches,
    loaded into a fresh loader, continues with batch k+1. Each prompt's ``uid`` is
    ``"<epoch>-<row>"``: unique within a batch and stable across reruns with the same seed.
    """

    def __init__(
        self,
        dataset: RLDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.dataset = dataset
        self.sampler = StatefulSampler(
            len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )

    def __len__(self) -> int:
        """Batches per epoch."""
        return self.sampler.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def batches_handed_out(self) -> int:
        """Batches handed out since the first epoch began (all epochs together)."""
        return self.sampler.epoch * self.sampler.batches_per_epoch + self.sampler.position

    def _make_batch(self, epoch: int, indices: Any) -> Batch:
        examples = self.dataset.get_rows(indices)
        return self.dataset.collate(examples, uids=[f"{epoch}-{e['row']}" for e in examples])

    def next_batch(self) -> Batch:
        return self._make_batch(*self.sampler.next_batch())

    def __iter__(self) -> Iterator[Batch]:
        for indices in self.sampler:
            yield self._make_batch(self.sampler.epoch, indices)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
