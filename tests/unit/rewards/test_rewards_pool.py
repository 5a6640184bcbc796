"""Isolated scoring workers: user code that raises, hangs, crashes or returns garbage costs a sample."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megarl.errors import ConfigError
from megarl.rewards.pool import ScoringPool
from megarl.rewards.worker import ScoringTarget

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

FNS = str(Path(__file__).with_name("user_reward_fns.py"))


def pool(name: str, num_workers: int = 2, timeout_s: float = 10.0, **kwargs) -> ScoringPool:
    return ScoringPool(ScoringTarget(FNS, name, kwargs), num_workers, timeout_s)


def call(text: str, truth: object = "1", source: str = "test", extra: object = None) -> tuple:
    return (source, text, truth, extra)


def test_results_come_back_in_order_with_numeric_extras() -> None:
    with pool("exact_match", bonus=0.5) as p:
        outcomes = p.map([call(str(i % 3)) for i in range(50)])
    assert [o.status for o in outcomes] == ["ok"] * 50
    assert [o.result["score"] for o in outcomes] == [1.5 if i % 3 == 1 else 0.5 for i in range(50)]
    assert [o.result["acc"] for o in outcomes] == [1.0 if i % 3 == 1 else 0.0 for i in range(50)]
    assert all("note" not in o.result for o in outcomes)


def test_extra_info_reaches_the_function() -> None:
    with pool("echo_extra_info", num_workers=1) as p:
        outcomes = p.map([call("x", source="weighted", extra={"weight": 0.25}), call("x")])
    assert [o.result["score"] for o in outcomes] == [0.25, -1.0]


def test_calls_spread_over_all_workers() -> None:
    with pool("slow", num_workers=2) as p:
        outcomes = p.map([call("x") for _ in range(8)])
    # Each call sleeps 0.2 s: an idle worker takes the next chunk, so both workers score.
    assert len({o.result["pid"] for o in outcomes}) == 2


def test_exceptions_are_reported_and_the_worker_survives() -> None:
    with pool("raises_on_bad", num_workers=1) as p:
        outcomes = p.map([call("ok"), call("bad"), call("exit"), call("ok")])
        assert p.restarts == 0
    assert [o.status for o in outcomes] == ["ok", "error", "error", "ok"]
    assert (
        "RuntimeError: boom in user code" in outcomes[1].reason and "user_reward_fns.py" in outcomes[1].reason
    )
    assert "SystemExit" in outcomes[2].reason


@pytest.mark.parametrize("kind", ["hang", "sleep"])
def test_hung_calls_time_out_and_the_rest_still_score(kind: str) -> None:
    with pool("hangs_on_hang", num_workers=2, timeout_s=0.5) as p:
        start = time.monotonic()
        outcomes = p.map([call("ok"), call(kind), call("ok"), call(kind), call("ok"), call("ok")])
        elapsed = time.monotonic() - start
        assert p.restarts == 2
        # The replaced workers serve the next batch.
        assert [o.status for o in p.map([call("ok")] * 4)] == ["ok"] * 4
    assert [o.status for o in outcomes] == ["ok", "timeout", "ok", "timeout", "ok", "ok"]
    assert "0.5 s" in outcomes[1].reason
    assert elapsed < 30  # never a hang


def test_crashing_worker_is_replaced() -> None:
    with pool("crashes_on_crash", num_workers=2) as p:
        outcomes = p.map([call("ok"), call("crash"), call("ok")] * 3)
        assert p.restarts == 3
    assert [o.status for o in outcomes] == ["ok", "crash", "ok"] * 3
    assert "code 3" in outcomes[1].reason
    assert [o.result["score"] for o in outcomes if o.status == "ok"] == [0.5] * 6


def test_bad_return_values() -> None:
    with pool("garbage", num_workers=1) as p:
        outcomes = p.map(
            [call(k) for k in ["nan", "inf", "str", "none", "list", "nodict", "dictnan", "numpy", "bool"]]
        )
    statuses = [o.status for o in outcomes]
    assert statuses == ["bad_return"] * 7 + ["ok", "ok"]
    assert "not a finite number" in outcomes[0].reason
    assert "without 'score'" in outcomes[5].reason
    assert outcomes[7].result == {"score": 0.25} and outcomes[8].result == {"score": 1.0}


@pytest.mark.parametrize(
    ("path", "name", "message"),
    [
        ("missing.py", "f", "does not exist"),
        (FNS, "nope", "has no function 'nope'.*exact_match"),
        (FNS, "NOT_CALLABLE", "not a function"),
    ],
)
def test_unloadable_function_is_a_config_error(tmp_path: Path, path: str, name: str, message: str) -> None:
    path = path if path == FNS else str(tmp_path / path)
    with pytest.raises(ConfigError, match=message) as error:
        ScoringPool(ScoringTarget(path, name), 1, 5.0)
    assert path in str(error.value)


def test_import_errors_and_slow_imports(tmp_path: Path) -> None:
    (tmp_path / "syntax.py").write_text("def f(:\n")
    with pytest.raises(ConfigError, match="SyntaxError"):
        ScoringPool(ScoringTarget(str(tmp_path / "syntax.py"), "f"), 1, 5.0)
    (tmp_path / "raising.py").write_text("raise ImportError('no such thing')\n")
    with pytest.raises(ConfigError, match="no such thing"):
        ScoringPool(ScoringTarget(str(tmp_path / "raising.py"), "f"), 1, 5.0)
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(60)\ndef f(**kw):\n    return 1\n")
    with pytest.raises(ConfigError, match="did not load within 1 s"):
        ScoringPool(ScoringTarget(str(tmp_path / "slow_import.py"), "f"), 1, 5.0, start_timeout_s=1.0)


def test_user_file_may_import_its_neighbours(tmp_path: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("VALUE = 0.75\n")
    (tmp_path / "fn.py").write_text("from helper_mod import VALUE\ndef f(**kw):\n    return VALUE\n")
    with ScoringPool(ScoringTarget(str(tmp_path / "fn.py"), "f"), 1, 5.0) as p:
        assert p.map([call("x")])[0].result == {"score": 0.75}


def test_builtin_scorers_in_workers() -> None:
    with ScoringPool(ScoringTarget(None, kwargs={"arithmetic": {"mode": "exact"}}), 2, 5.0) as p:
        outcomes = p.map(
            [
                call("7", "7", "arithmetic"),
                call("7+", "7", "arithmetic"),
                call("#### 3", "3", "openai/gsm8k"),
                call("1", "1", "unknown"),
            ]
        )
    assert [o.result["score"] if o.result else o.status for o in outcomes] == [1.0, 0.0, 1.0, "error"]
    assert "UnknownDataSourceError" in outcomes[3].reason


def test_closed_pool_stops_its_processes() -> None:
    p = pool("exact_match", num_workers=2)
    processes = [w.process for w in p._workers]
    p.close()
    assert all(proc.poll() is not None for proc in processes)
    p.close()  # idempotent


def test_worker_killed_while_idle_is_replaced_without_charging_a_call() -> None:
    with pool("exact_match", num_workers=1) as p:
        victim = p._workers[0].process
        victim.kill()
        victim.wait()
        outcomes = p.map([call("1"), call("2")])
        assert p.restarts == 1
    assert [o.status for o in outcomes] == ["ok", "ok"]


def test_workers_start_clean_without_the_drivers_imports() -> None:
    import torch  # noqa: F401 - the driver has torch loaded; a fresh worker must not

    with pool("torch_loaded", num_workers=1) as p:
        assert p.map([call("x")])[0].result == {"score": 0.0}
