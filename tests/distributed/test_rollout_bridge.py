"""The bridge between the training pool and a separate rollout pool (`megarl.hybrid.bridge`), on two
real gloo processes: a shard arrives exactly, split over buckets anywhere (inside a tensor too), and
a bucket changed in transport is caught with the tensor, its element range and both ranks named."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _launch import run_distributed
from megarl.hybrid.bridge import ShardLayout, ShardTensor, open_bridge, receive_shard, send_shard
from megarl.hybrid.verify import WeightSyncError

pytestmark = pytest.mark.distributed

LAYOUT = ShardLayout((ShardTensor("model.embed_tokens.weight", (7, 5)), ShardTensor("model.norm.weight", (5,)),
                      ShardTensor("lm_head.weight", (7, 5))), torch.float32, "hf")
BUCKET_BYTES = 4 * 16  # 16 floats: buckets cut through every tensor but the norm


def shard() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t.shape, generator=g) for t in LAYOUT.tensors]


class FlipOneByte:
    """Stands in for the bridge group at the receiver: flips one byte of the `nth` data bucket."""

    def __init__(self, group: Any, nth: int) -> None:
        self.group, self.nth, self.seen = group, nth, 0

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self.group.recv(tensors, src, tag).wait()
        if tag == 0:
            if self.seen == self.nth:
                tensors[0].view(torch.uint8)[3] ^= 0x10
            self.seen += 1
        return self

    def wait(self) -> bool:  # the receive above is complete
        return True


def _exchange(rank: int, world: int, port: int, corrupt_bucket: int | None) -> Any:
    bridge = open_bridge("127.0.0.1", port, rank, world, timeout_s=60)
    if rank == 0:
        return send_shard(bridge, 1, shard(), LAYOUT, BUCKET_BYTES, verify=True)
    group = bridge if corrupt_bucket is None else FlipOneByte(bridge, corrupt_bucket)
    targets = [torch.zeros(t.shape) for t in LAYOUT.tensors]
    try:
        stats = receive_shard(group, 0, targets, LAYOUT, BUCKET_BYTES, verify=True, rank=0)
    except WeightSyncError as error:
        return str(error)
    return stats.bytes_received, stats.minimum_bytes, stats.buckets_received, targets


def test_a_shard_arrives_exactly_in_buckets() -> None:
    sent, (received, minimum, buckets, targets) = run_distributed(_exchange, 2, None)
    total = sum(t.numel() for t in shard()) * 4
    assert sent == received == minimum == total == 300
    assert buckets == 5  # 75 floats in buckets of 16
    for got, want in zip(targets, shard()):
        assert torch.equal(got, want)


def test_a_changed_bucket_is_named() -> None:
    # Bucket 2 holds floats 32..47: the norm (35..39) and the start of lm_head (40..47), after the
    # last 3 of the embedding (32..34).
    _, message = run_distributed(_exchange, 2, 2)
    assert message == ("weight sync over the rollout bridge: 1 bucket(s) from training rank 0 arrived changed at "
                       "rollout rank 0; tensors (element ranges) of the first: model.embed_tokens.weight[32:35], "
                       "model.norm.weight[0:5], lm_head.weight[0:8]")


PADDED = ShardLayout((ShardTensor("lm_head.weight", (8, 3), axis=0, covered=((0, 5),)),
                      ShardTensor("model.norm.weight", (3,))), torch.float32, "vllm")


def _exchange_padded(rank: int, world: int, port: int) -> Any:
    bridge = open_bridge("127.0.0.1", port, rank, world, timeout_s=60)
    full = [torch.arange(24.0).view(8, 3), torch.ones(3)]
    if rank == 0:
        return send_shard(bridge, 1, full, PADDED, 4 * 4, verify=True)
    targets = [torch.full((8, 3), 7.0), torch.zeros(3)]
    stats = receive_shard(bridge, 0, targets, PADDED, 4 * 4, verify=True, rank=0)
    return stats.bytes_received, stats.minimum_bytes, targets


def test_padding_rows_are_zeroed_and_never_sent() -> None:
    sent, (received, minimum, (head, norm)) = run_distributed(_exchange_padded, 2)
    assert sent == received == minimum == (5 * 3 + 3) * 4  # rows 5..7 of lm_head are vocabulary padding
    assert torch.equal(head[:5], torch.arange(15.0).view(5, 3)) and torch.equal(head[5:], torch.zeros(3, 3))
    assert torch.equal(norm, torch.ones(3))


def test_a_tensor_of_padding_only_sends_nothing() -> None:
    # Rollout rank 1 of a 17-token vocabulary padded to 64 at TP=2: rows 32..63, all padding.
    layout = ShardLayout((ShardTensor("lm_head.weight", (32, 3), axis=0, covered=()),), torch.float32, "vllm")
    assert layout.nbytes == 0 and layout.regions() == []
    target = torch.full((32, 3), 7.0)
    stats = receive_shard(None, 0, [target], layout, 16, verify=True, rank=1)  # nothing to receive: no group
    assert stats.bytes_received == stats.minimum_bytes == 0 and torch.equal(target, torch.zeros(32, 3))
