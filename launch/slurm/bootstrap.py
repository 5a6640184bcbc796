#!/usr/bin/env python3
"""Start Ray on one node of a SLURM allocation; on node 0 also run the trainer, then tear everything down.

``megarl.sbatch`` runs this once per node (``srun --ntasks-per-node=1``):

    bootstrap.py [--dry-run] CONFIG [OVERRIDES...]

- node 0: read CONFIG's resource pools (the actor pool gets the nodes the other pools leave; pools that
  do not add up to the allocation are refused here, exit status 2, before Ray starts), ``ray start
  --head --block`` in the background, wait until every node of the allocation has joined
  (``ray.nodes()``; timeout -> a clear error), run ``megarl train CONFIG <derived overrides>
  OVERRIDES`` with ``RAY_ADDRESS`` set, then stop the head. Exit status = the trainer's (128 + N when
  a signal N ended it), also written to MEGARL_JOB_STATE_DIR/trainer.status when megarl.sbatch set
  that directory (srun's own status mixes in the other nodes').
- node k > 0: wait until the head accepts connections, ``ray start --address=HEAD:PORT --block``, and
  stop once the head has been gone for MEGARL_HEAD_GRACE seconds (the job is over).
- SIGTERM / SIGINT (scancel, time limit, Ctrl-C) on node 0 while the trainer runs: SIGTERM to the
  trainer alone, which finishes its step, writes a checkpoint and exits with 75 (EXIT_STOPPED_FOR_RESUME
  of megarl.trainer.loop; megarl.sbatch requeues the job on it); killed after MEGARL_STOP_TIMEOUT
  seconds. Then, as on any other node and at any other time: stop this node's Ray processes.
  megarl.sbatch signals node 0's bootstrap alone (its pid is in MEGARL_JOB_STATE_DIR/bootstrap.pid),
  so that the Ray processes the trainer saves through keep running meanwhile.

``--dry-run`` (or MEGARL_DRY_RUN=1) prints the commands of every node and starts nothing.
Knobs are environment variables, listed in ``node_plan.LaunchSettings``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType
from typing import Mapping, Optional, Sequence

from node_plan import LaunchSettings, NodePlan, format_plan, plan_cluster, plan_node, resolve_head_ip
from slurm_env import LaunchError, allocation_from_env

POLL_S = 0.5
STOP_TIMEOUT_S = 60.0


class Terminated(Exception):
    """Raised in the main thread when SIGTERM/SIGINT arrives, so ``finally`` blocks tear down."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received signal {signum}")
        self.signum = signum


def _raise_terminated(signum: int, frame: Optional[FrameType]) -> None:
    # One teardown is enough: a second signal must not interrupt it half-way.
    ignore_signals()
    raise Terminated(signum)


def ignore_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGINT, _raise_terminated)


def with_local_executable(cmd: list[str]) -> list[str]:
    """Run ``ray``/``megarl`` from this Python's environment when it has them, else from PATH."""
    if "/" in cmd[0]:
        return cmd
    sibling = os.path.join(os.path.dirname(sys.executable), cmd[0])
    return [sibling] + cmd[1:] if os.access(sibling, os.X_OK) else cmd


def exit_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: ``Popen.returncode`` -N (killed by signal N) is
    128 + N (137 for SIGKILL); ``sys.exit(-9)`` would exit 247 instead."""
    return 128 - returncode if returncode < 0 else returncode


def write_state(settings: LaunchSettings, name: str, value: object) -> None:
    """Leave ``value`` in MEGARL_JOB_STATE_DIR/``name`` for megarl.sbatch (nothing when it is unset):
    written to a temporary name and renamed, so that the batch script never reads half a file."""
    if not settings.state_dir:
        return
    path = os.path.join(settings.state_dir, name)
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{value}\n")
        os.replace(path + ".tmp", path)
    except OSError as err:  # the batch script then falls back to srun's status
        log(f"could not write {path} (MEGARL_JOB_STATE_DIR): {err}")


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} [megarl-bootstrap {socket.gethostname()}] {message}", file=sys.stderr, flush=True)


def environ_with(extra: Mapping[str, str]) -> dict[str, str]:
    """A copy of this process's environment with ``extra`` applied."""
    return {**os.environ, **extra}


def port_open(address: str, timeout_s: float = 1.0) -> bool:
    """True if ``HOST:PORT`` accepts a TCP connection."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def stop_process(proc: Optional[subprocess.Popen], name: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait, then SIGKILL. ``ray start --block`` stops its node's Ray processes on SIGTERM."""
    if proc is None or proc.poll() is not None:
        return
    log(f"stopping {name} (pid {proc.pid})")
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log(f"{name} did not stop within {timeout_s:g} s: killing it")
        proc.kill()
        proc.wait(timeout=timeout_s)


def wait_for_nodes(plan: NodePlan, head: subprocess.Popen, settings: LaunchSettings) -> list[dict]:
    """Block until ``plan.expected_nodes`` Ray nodes are alive; return them. Raises LaunchError on timeout.

    The head gets ``settings.head_start_timeout_s`` to open its GCS port; the other nodes then get
    ``settings.wait_timeout_s`` to join.
    """
    import ray  # only the head needs it, and only now

    deadline = time.monotonic() + settings.head_start_timeout_s
    while not port_open(plan.head_address):
        if head.poll() is not None:
            raise LaunchError(f"the Ray head exited with status {head.returncode} before its GCS came up")
        if time.monotonic() > deadline:
            raise LaunchError(
                f"the Ray head's GCS at {plan.head_address} did not come up within "
                f"{settings.head_start_timeout_s:g} s (MEGARL_HEAD_START_TIMEOUT)"
            )
        time.sleep(POLL_S)
    timeout_s = settings.wait_timeout_s
    deadline = time.monotonic() + timeout_s
    ray.init(address=plan.head_address, logging_level="WARNING", log_to_driver=False)
    install_signal_handlers()  # ray.init and ray.shutdown replace the SIGTERM handler
    terminated = False
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if len(alive) >= plan.expected_nodes:
                return alive
            if head.poll() is not None:
                raise LaunchError(f"the Ray head exited with status {head.returncode} while waiting for workers")
            if time.monotonic() > deadline:
                joined = sorted(n.get("NodeManagerAddress", "?") for n in alive)
                raise LaunchError(
                    f"only {len(alive)} of {plan.expected_nodes} Ray nodes joined {plan.head_address} within "
                    f"{timeout_s:g} s (joined: {', '.join(joined)}). Check the workers' output for `ray start` "
                    "errors, that they can reach the head's port, and the MEGARL_WAIT_TIMEOUT setting."
                )
            time.sleep(POLL_S)
    except Terminated:
        terminated = True
        raise
    finally:
        ray.shutdown()
        if terminated:
            # The signal's handler switched to ignoring further signals for the teardown that
            # follows: raising again there could cut it short. Keep them ignored, whatever
            # ray.shutdown set.
            ignore_signals()
        else:
            install_signal_handlers()


def run_head(plan: NodePlan, settings: LaunchSettings) -> int:
    assert plan.driver is not None
    head: Optional[subprocess.Popen] = None
    driver: Optional[subprocess.Popen] = None
    try:
        log("starting the Ray head: " + " ".join(plan.ray_start))
        head = subprocess.Popen(with_local_executable(plan.ray_start), env=environ_with(plan.env))
        alive = wait_for_nodes(plan, head, settings)
        log(f"{len(alive)} Ray nodes alive; running: " + " ".join(plan.driver))
        driver_env = environ_with({**plan.env, "RAY_ADDRESS": plan.head_address})
        driver = subprocess.Popen(with_local_executable(plan.driver), env=driver_env)
        try:
            code = exit_status(driver.wait())
        except Terminated as err:
            code = stop_trainer(driver, err.signum, settings.stop_timeout_s)
        log(f"trainer exited with status {code}")
        write_state(settings, "trainer.status", code)  # before Ray stops: the workers then end the srun step
        return code
    finally:
        stop_process(driver, "the trainer")
        stop_process(head, "the Ray head")


def stop_trainer(driver: subprocess.Popen, signum: int, timeout_s: float) -> int:
    """Ask the trainer to stop (SIGTERM: it finishes its step and writes a checkpoint of it first) and
    wait up to ``timeout_s`` for it; then kill it. Returns its exit status (128 + ``signum`` when it had
    to be killed). Runs with further signals ignored (`_raise_terminated`): the stop is not cut short."""
    log(f"received signal {signum}: asking the trainer (pid {driver.pid}) to stop after its current step, with a "
        f"checkpoint; it is killed if still running in {timeout_s:g} s (MEGARL_STOP_TIMEOUT)")
    driver.terminate()
    try:
        return exit_status(driver.wait(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        log(f"the trainer did not stop within {timeout_s:g} s (MEGARL_STOP_TIMEOUT): killing it; a rerun resumes "
            "from its last periodic checkpoint")
        driver.kill()
        driver.wait()
        return 128 + signum


def run_worker(plan: NodePlan, settings: LaunchSettings) -> int:
    worker: Optional[subprocess.Popen] = None
    try:
        patience_s = settings.head_start_timeout_s + settings.wait_timeout_s
        deadline = time.monotonic() + patience_s
        while not port_open(plan.head_address):
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"node {plan.rank} ({plan.host}): the Ray head {plan.head_address} did not accept connections "
                    f"within {patience_s:g} s"
                )
            time.sleep(POLL_S)
        log(f"node {plan.rank}: joining {plan.head_address}: " + " ".join(plan.ray_start))
        worker = subprocess.Popen(with_local_executable(plan.ray_start), env=environ_with(plan.env))
        gone_since: Optional[float] = None
        while True:
            code = worker.poll()
            if code is not None:
                code = exit_status(code)
                log(f"node {plan.rank}: `ray start` exited with status {code}")
                return code
            if port_open(plan.head_address):
                gone_since = None
            elif gone_since is None:
                gone_since = time.monotonic()
            elif time.monotonic() - gone_since > settings.head_grace_s:
                log(f"node {plan.rank}: the head is gone; stopping")
                return 0
            time.sleep(1.0)
    finally:
        stop_process(worker, f"Ray on node {plan.rank}")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print every node's commands; start nothing")
    parser.add_argument("config", help="experiment YAML (a path every node can read)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ)
    try:
        settings = LaunchSettings.from_env(env)
        alloc = allocation_from_env(env)
        if args.dry_run or env.get("MEGARL_DRY_RUN", "") not in ("", "0"):
            print(format_plan(plan_cluster(alloc, settings, args.config, args.overrides), settings), end="")
            return 0
        head_ip = resolve_head_ip(alloc, settings)
        plan = plan_node(alloc, settings, alloc.node_rank, args.config, args.overrides, head_ip)
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    install_signal_handlers()
    if plan.is_head:
        write_state(settings, "bootstrap.pid", os.getpid())
    try:
        return run_head(plan, settings) if plan.is_head else run_worker(plan, settings)
    except LaunchError as err:
        log(f"error: {err}")
        return 1
    except Terminated as err:
        log(f"{err}: tore down this node")
        return 128 + err.signum
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # teardown is done; do not interrupt `ray stop`
        if settings.ray_stop_all:
            subprocess.run(with_local_executable(["ray", "stop", "--force"]), check=False, timeout=STOP_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main())
