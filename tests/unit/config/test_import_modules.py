"""`algorithm.import_modules`: the user's modules registering advantage estimators, policy losses and KL
estimators are imported by the driver before the config is checked and by the actor's loss before it
is built. Each check runs in a fresh interpreter: the registries are per process, as on the workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
PLUGIN = (Path(__file__).parent / "user_algorithms.py").read_text()
USES = ("algorithm.adv_estimator=plugin_adv", "actor.policy_loss.loss_mode=plugin_loss", "actor.use_kl_loss=true",
        "actor.kl_loss_type=plugin_kl+")


def validate(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", "config", "validate", "--schema-only",
                           str(REPO / "configs" / "quickstart_cpu.yaml"), *overrides],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    path = tmp_path / "my_algorithms.py"
    path.write_text(PLUGIN)
    return path


def test_registered_names_are_valid_once_their_module_is_named(plugin: Path) -> None:
    proc = validate(*USES)
    assert proc.returncode == 1
    for part in ("algorithm.adv_estimator = 'plugin_adv'", "actor.policy_loss.loss_mode = 'plugin_loss'",
                 "actor.kl_loss_type = 'plugin_kl+'"):
        assert part in proc.stderr
    proc = validate(f"algorithm.import_modules=[{plugin}]", *USES)
    assert proc.returncode == 0, proc.stderr


def test_a_module_that_cannot_be_imported_is_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    proc = validate(f"algorithm.import_modules=[{broken}]")
    assert proc.returncode == 1
    assert f"algorithm.import_modules: importing '{broken}' failed: RuntimeError: no GPU here" in proc.stderr


def test_missing_entries_are_named(tmp_path: Path) -> None:
    proc = validate("algorithm.import_modules=[no_such_module_xyz]")
    assert "algorithm.import_modules: importing 'no_such_module_xyz' failed: ModuleNotFoundError" in proc.stderr
    proc = validate(f"algorithm.import_modules=[{tmp_path / 'missing.py'}]")
    assert f"algorithm.import_modules: '{tmp_path / 'missing.py'}' is not a file" in proc.stderr


LOSS_PROBE = """
import sys
from megarl.errors import ConfigError
from megarl.workers.losses import ActorLossSpec, make_actor_loss
try:
    make_actor_loss(ActorLossSpec(loss_mode="plugin_loss", use_kl_loss=True, kl_loss_type="plugin_kl",
                                  import_modules=tuple(sys.argv[1:])))
    print("BUILT")
except ConfigError as exc:
    print("REFUSED", exc)
"""


def test_the_actor_loss_imports_them_in_its_own_process(plugin: Path) -> None:
    def build(*modules: str) -> str:
        return subprocess.run([sys.executable, "-c", LOSS_PROBE, *modules], capture_output=True, text=True,
                              timeout=120, check=True).stdout
    assert "REFUSED actor.policy_loss.loss_mode = 'plugin_loss': unknown policy loss" in build()
    assert build(str(plugin)).strip() == "BUILT"
