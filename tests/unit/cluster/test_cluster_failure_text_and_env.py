"""A remote error's message without Ray's colour codes, and `start_or_connect` undoing what it set
in the environment when `ray.init` fails."""

from __future__ import annotations

import os
import traceback

import pytest
from ray.exceptions import RayTaskError

from megarl.cluster import ray_cluster
from megarl.cluster.remote_call import RankCall, _failure_message, describe_failure

pytestmark = pytest.mark.unit


def _task_error(message: str) -> RayTaskError:
    try:
        raise ValueError(message)
    except ValueError as cause:
        # Ray colours the process title of the failed task (`ray::W.fail_on()`) in its text.
        return RayTaskError("fail_on", traceback.format_exc(), cause, proctitle="ray::W.fail_on()", pid=1, ip="10.0.0.1")


def test_a_remote_exception_reads_without_colour_codes() -> None:
    error = _task_error("deliberate failure on 1")
    assert "\x1b[" in str(error)  # what Ray gives
    call = RankCall("actor", 1, "10.0.0.1", "fail_on", None)
    message = describe_failure(call, error)
    assert "\x1b[" not in message
    assert message.startswith("actor rank 1 on node 10.0.0.1 raised in fail_on():\nray::W.fail_on()")
    assert message.endswith("ValueError: deliberate failure on 1")
    both = _failure_message([(call, error), (RankCall("actor", 0, "10.0.0.1", "fail_on", None), _task_error("x"))])
    assert "\x1b[" not in both


ENV = (ray_cluster.AUTH_MODE_ENV, ray_cluster.LOCAL_GCS_CONNECT_ENV, ray_cluster.REAPER_TAG_ENV)


@pytest.mark.parametrize("before", [{}, {ray_cluster.AUTH_MODE_ENV: "token", ray_cluster.REAPER_TAG_ENV: "outer"}])
def test_a_failed_ray_init_leaves_the_environment_as_it_was(monkeypatch: pytest.MonkeyPatch, before: dict) -> None:
    """Before, only the reaper's tag was restored: RAY_AUTH_MODE=disabled and the GCS connect
    timeout stayed set for whatever the process started next."""
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in before.items():
        monkeypatch.setenv(key, value)

    def failing_init(*args, **kwargs):
        assert os.environ[ray_cluster.LOCAL_GCS_CONNECT_ENV] == ray_cluster.LOCAL_GCS_CONNECT_TIMEOUT_S
        raise RuntimeError("init failed")

    monkeypatch.setattr(ray_cluster.ray, "init", failing_init)
    monkeypatch.setattr(ray_cluster, "start_reaper", lambda tag: None)  # no reaper process for this
    with pytest.raises(RuntimeError, match="init failed"):
        with ray_cluster.start_or_connect():
            pass
    assert {key: os.environ.get(key) for key in ENV} == {key: before.get(key) for key in ENV}
