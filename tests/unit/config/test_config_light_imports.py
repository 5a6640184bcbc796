"""A config error is reported without importing torch, transformers, Megatron or Ray: `megarl config
validate` and `megarl train` load only the config package and the command's own module, and the
validation rules and file checks read YAML, JSON and file headers. The constants the rules keep to
stay light are checked here against the heavy modules they mirror."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import algorithm_rules, model_files, rules, validate
from test_run_files import experiment, write_task

pytestmark = pytest.mark.unit

HEAVY = ("torch", "transformers", "megatron", "ray", "safetensors", "pyarrow")
PROBE = """
import json, sys
from megarl.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print("PROBE " + json.dumps({{"code": code, "heavy": heavy}}))
"""


def run_cli(*args: str) -> tuple[int, list[str], str]:
    """Run `megarl ARGS` in a fresh interpreter: (exit code, heavy packages imported, stderr)."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], capture_output=True, text=True,
                          timeout=120)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))
    result = json.loads(line[len("PROBE "):])
    return result["code"], result["heavy"], proc.stderr


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return experiment(tmp_path, write_task(tmp_path))


def test_typo_and_rule_errors_import_nothing_heavy(config: Path) -> None:
    code, heavy, err = run_cli("config", "validate", str(config), "trainer.totl_training_steps=3")
    assert code == 1 and heavy == []
    assert "unknown key 'trainer.totl_training_steps'; did you mean 'trainer.total_training_steps'?" in err
    code, heavy, err = run_cli("train", str(config), "trainer.totl_training_steps=3")
    assert code == 1 and heavy == [] and "did you mean 'trainer.total_training_steps'?" in err
    # Rules that used to import torch: the registries, model.spec families, dynamic-batch budget.
    code, heavy, err = run_cli("config", "validate", str(config), "rollout.n=0", "model.spec=qwen9",
                               "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4",
                               "algorithm.adv_estimator=grpox")
    assert code == 1 and heavy == []
    for part in ("rollout.n = 0: must be > 0", "model.spec = 'qwen9': no such family",
                 "actor.ppo_max_token_len_per_gpu = 4", "algorithm.adv_estimator = 'grpox'"):
        assert part in err


def test_file_checks_import_nothing_heavy(config: Path) -> None:
    code, heavy, err = run_cli("config", "validate", str(config))
    assert (code, heavy) == (0, []), err
    weights = config.parent / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    code, heavy, err = run_cli("config", "validate", str(config))
    assert code == 1 and heavy == [] and f"model.path: {weights}: truncated" in err
    # `megarl train` reports it before importing what the run needs.
    code, heavy, err = run_cli("train", str(config))
    assert code == 1 and heavy == [] and f"model.path: {weights}: truncated" in err


def test_light_constants_equal_the_modules_they_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import megarl.algorithms as algos  # the registries themselves (torch)
    from megarl.megatron.context_parallel import padded_length
    from megarl.models.spec import load_family_specs, spec_dir
    from megarl.rewards.model_scores import COMBINES

    assert validate._BUILTIN_ADV == set(algos.ADVANTAGE_ESTIMATORS)
    assert validate._BUILTIN_POLICY_LOSSES == set(algos.POLICY_LOSSES)
    assert algorithm_rules.REWARD_MODEL_COMBINES == tuple(COMBINES)
    for length in range(1, 40):
        for cp in (1, 2, 3, 4):
            assert rules.cp_padded_length(length, cp) == padded_length(length, cp)
    assert model_files.spec_dir() == spec_dir()
    assert {k: v["model_types"] for k, v in model_files.family_specs().items()} == \
        {k: v["model_types"] for k, v in load_family_specs().items()}
    # Both follow $MEGARL_MODEL_SPECS.
    (tmp_path / "toy.yaml").write_text(json.dumps({"family": "toy", "model_types": ["toy"], "config_map": {},
                                                   "weight_map": []}))
    monkeypatch.setenv(model_files.SPEC_DIR_ENV, str(tmp_path))
    assert model_files.spec_dir() == spec_dir() == tmp_path
    assert set(model_files.family_specs()) == set(load_family_specs()) == {"toy"}


def test_a_registered_estimator_is_accepted_once_the_registry_is_imported() -> None:
    import megarl.algorithms as algos  # where users register their own

    assert "my_adv" not in validate.registered_names("advantage")
    algos.ADVANTAGE_ESTIMATORS.register("my_adv")(lambda **kwargs: None)
    try:
        assert "my_adv" in validate.registered_names("advantage")
    finally:
        algos.ADVANTAGE_ESTIMATORS._fns.pop("my_adv")


def test_a_missing_model_specs_folder_is_named_with_the_variable_to_set(tmp_path, monkeypatch) -> None:
    """megarl installed outside a checkout (e.g. a non-editable install in an image) has no
    model_specs/ beside it: the error says which folder it looked for and what to set."""
    from megarl.errors import ConfigError

    monkeypatch.setenv(model_files.SPEC_DIR_ENV, str(tmp_path / "absent"))
    with pytest.raises(ConfigError) as err:
        model_files.family_specs()
    assert str(tmp_path / "absent") in str(err.value) and "MEGARL_MODEL_SPECS" in str(err.value)


HELP_PROBE = """
import json, sys
from megarl.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
print("PROBE " + json.dumps({{"code": code, "heavy": heavy}}))
"""


@pytest.mark.parametrize("command", [("--help",), ("convert", "--help"), ("sync", "plan", "--help"),
                                     ("checkpoint", "--help"), ("report", "--help")])
def test_help_imports_nothing_heavy(command: tuple[str, ...]) -> None:
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE.format(heavy=HEAVY), *command], capture_output=True,
                          text=True, timeout=120)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))
    result = json.loads(line[len("PROBE "):])
    assert result["code"] == 0 and "usage: megarl" in proc.stdout
    assert result["heavy"] == [], f"megarl {' '.join(command)} imported {result['heavy']}"
