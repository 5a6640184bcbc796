"""Stand-in for `megarl train` in the SLURM bootstrap tests that check the cluster plumbing itself.

Called exactly as the trainer would be: ``standin_train.py CONFIG OVERRIDES...``. It connects to the
cluster named by ``resources.ray_address``, runs one task pinned to each alive node, and writes what
it saw to the JSON file named by STANDIN_OUT. With STANDIN_HOLD_S it then keeps running that long
(the cancel test stops it half-way); STANDIN_EXIT is its exit status (a failed training run).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> int:
    config, overrides = sys.argv[1], sys.argv[2:]
    values = dict(item.split("=", 1) for item in overrides)

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=values["resources.ray_address"], logging_level="ERROR", log_to_driver=False)
    # As `megarl train` outside its training loop (megarl.cluster.ray_cluster.start_or_connect): SIGTERM
    # exits with 128 + 15; ray.init's own handler would exit with 15.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    @ray.remote(num_cpus=1)
    def node_of_task() -> str:
        return ray.get_runtime_context().get_node_id()

    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    pinned = [
        node_of_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        for node_id in alive
    ]
    ran_on = ray.get(pinned, timeout=180)
    report = {
        "config": config,
        "overrides": overrides,
        "ray_address_env": os.environ.get("RAY_ADDRESS"),
        "alive_nodes": alive,
        "ran_on": ran_on,
    }
    with open(os.environ["STANDIN_OUT"], "w") as f:
        json.dump(report, f)
    time.sleep(float(os.environ.get("STANDIN_HOLD_S", "0")))
    ray.shutdown()
    return int(os.environ.get("STANDIN_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
