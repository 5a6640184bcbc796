"""`algorithm.import_modules`: the user's Python modules that register advantage estimators, policy
losses or KL estimators (`megarl.algorithms.register_*`).

The registries are per process: the driver runs the advantage estimator and the KL in the reward, the
actor's workers the policy loss and the KL loss. So the driver imports these modules before the
config is checked (the names they register are then valid values of the config's keys), and every
actor worker imports them before it builds its loss. Each entry is a dotted module name importable on
every node, or the path of a `.py` file (read on every node: a shared or copied file). A module is
imported once per process, however often the config is loaded.

This module imports nothing heavy; the modules it imports usually import `megarl.algorithms`
(torch).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from megarl.errors import ConfigError

KEY = "algorithm.import_modules"


def _file_module_name(path: str) -> str:
    return "megarl_user_algorithms_" + hashlib.sha1(path.encode()).hexdigest()[:16]


def import_module_entry(entry: str) -> ModuleType:
    """Import one `algorithm.import_modules` entry (a dotted name or a .py path); ConfigError naming the
    key and the entry when it cannot be imported, with the error the import raised."""
    try:
        if entry.endswith(".py"):
            path = os.path.abspath(entry)
            if not os.path.isfile(path):
                raise ConfigError(f"{KEY}: {entry!r} is not a file (an entry is a dotted module name or a .py path)")
            name = _file_module_name(path)
            if name in sys.modules:
                return sys.modules[name]
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ConfigError(f"{KEY}: {entry!r} cannot be imported as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
        return importlib.import_module(entry)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module failed: name it, keep the cause
        raise ConfigError(f"{KEY}: importing {entry!r} failed: {type(exc).__name__}: {exc}") from exc


def import_modules(entries: Sequence[str]) -> list[ModuleType]:
    """Import every entry, in order (see `import_module_entry`)."""
    return [import_module_entry(str(entry)) for entry in entries]
