"""Cluster tests: a local Ray cluster per module, and the test worker classes shipped by value."""

from __future__ import annotations

from collections.abc import Iterator

import cluster_workers
import pytest
import ray.cloudpickle

from megarl.cluster.ray_cluster import ClusterInfo, start_or_connect

# The test directory is not importable inside Ray's worker processes: send these classes by value.
ray.cloudpickle.register_pickle_by_value(cluster_workers)


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[ClusterInfo]:
    """One local Ray cluster for all tests of a module: 6 logical CPUs, 200 MB object store."""
    with start_or_connect(num_cpus=6, object_store_memory_gb=0.2) as info:
        yield info


class Cleanup:
    """Shuts down what a test created (groups before pools), even when the test fails."""

    def __init__(self) -> None:
        self.items: list = []

    def __call__(self, item):  # returns item, so it can wrap a constructor call
        self.items.append(item)
        return item

    def run(self) -> None:
        for item in reversed(self.items):
            item.shutdown()


@pytest.fixture
def cleanup(local_cluster: ClusterInfo) -> Iterator[Cleanup]:
    tracker = Cleanup()
    yield tracker
    tracker.run()
