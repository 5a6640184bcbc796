"""Replace modules inside a Megatron layer spec (a tree of ModuleSpecs, dataclass submodules, lists)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec


def replace_modules(layer_spec: Any, matches: Callable[[Any], bool], replacement: type) -> tuple[Any, int]:
    """A deep copy of `layer_spec` with every node that `matches` (a module class or a ModuleSpec)
    replaced by `replacement`; returns the copy and how many nodes were replaced."""
    replaced = 0

    def visit(node: Any) -> Any:
        nonlocal replaced
        if matches(node):
            replaced += 1
            return replacement
        if isinstance(node, ModuleSpec):
            node.submodules = visit(node.submodules)
            return node
        if isinstance(node, (list, tuple)):
            return type(node)(visit(n) for n in node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                setattr(node, f.name, visit(getattr(node, f.name)))
        return node

    return visit(copy.deepcopy(layer_spec)), replaced
