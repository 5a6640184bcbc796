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


@ray.remote(num_cpus=0, max_retries=0)
def node_address_and_free_port() -> tuple[str, int]:
    """(IP of the node this task runs on, a port free there). Scheduled into rank 0's bundle."""
    return ray.util.get_node_ip_address(), free_port()
