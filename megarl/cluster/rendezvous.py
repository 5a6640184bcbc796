"""Choosing the torch.distributed rendezvous address on rank 0's node.

Kept free of heavy imports: the task below runs in a fresh Ray worker process, which imports this
module (and only this one) to run it.
"""

from __future__ import annotations

import socket

import ray


def free_port(host: str = "") -> int:
    """A TCP port that is free on this machine right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def address_and_free_port() -> tuple[str, int]:
    """(IP of the node this process runs on, a port free there)."""
    return ray.util.get_node_ip_address(), free_port()


# The same as a task, scheduled by WorkerGroup into rank 0's bundle before any worker exists.
node_address_and_free_port = ray.remote(num_cpus=0, max_retries=0)(address_and_free_port)
