"""A driver that starts a local cluster and a 2-rank group, says READY, then waits to be stopped.

Run by test_cluster_cleanup.py, which interrupts it (SIGINT / SIGTERM) and checks that every
process it started is gone. With ``--churn`` it starts and kills one actor after another instead
of waiting, so that raylet is always starting a new worker process when the test kills it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

import ray

from megarl.cluster.ray_cluster import start_or_connect
from megarl.cluster.resource_pool import ResourcePool
from megarl.cluster.worker import Worker
from megarl.cluster.worker_group import WorkerGroup


class IdleWorker(Worker):
    pass


@ray.remote(num_cpus=0)
class Shortlived:
    def ping(self) -> int:
        return os.getpid()


def main() -> None:
    # Ctrl-C raises KeyboardInterrupt even when this process inherited SIGINT ignored (a shell starts
    # background jobs so, and Python then installs no handler): the test sends SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The test sends SIGUSR1 to a driver that does not exit in time: every thread's stack, to stdout.
    faulthandler.register(signal.SIGUSR1, file=sys.stdout, all_threads=True)
    with start_or_connect(num_cpus=2, object_store_memory_gb=0.1):
        pool = ResourcePool("idle", nnodes=1, devices_per_node=2).wait(timeout_s=120)
        group = WorkerGroup(pool, IdleWorker, "idle")
        try:  # READY inside: the test may interrupt as soon as it reads it
            print("READY", " ".join(str(info.pid) for info in group.node_infos), flush=True)
            while True:
                if "--churn" in sys.argv:
                    actor = Shortlived.remote()
                    ray.get(actor.ping.remote())
                    ray.kill(actor)
                else:
                    time.sleep(0.1)
        finally:
            # Straight to the file descriptor: no Python-level stdout buffer or lock between the
            # interrupted main thread and the pipe the test reads.
            os.write(sys.stdout.fileno(), b"CLEANING UP\n")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
