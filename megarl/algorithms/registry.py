"""Name -> function registries, so users can plug in their own estimators and losses by name."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from megarl.errors import ConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named collection of functions of one kind (e.g. advantage estimators).

    Iterating yields the registered names; ``name in registry`` tests membership.
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key  # the config key users set, quoted in error messages
        self._fns: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator registering a function under one or more names.

        Registering a *different* function under a taken name is an error (two plug-ins
        silently shadowing each other is worse than a loud failure at import time).
        """
        if not names:
            raise ValueError(f"register a {self.kind} under at least one name")

        def decorator(fn: F) -> F:
            for name in names:
                if not isinstance(name, str) or not name:
                    raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
                current = self._fns.get(name)
                if current is not None and current is not fn:
                    raise ValueError(
                        f"{self.kind} {name!r} is already registered to {current.__module__}.{current.__qualname__}; "
                        "choose another name"
                    )
                self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered under ``name``; ConfigError listing the valid names otherwise."""
        try:
            return self._fns[name]
        except KeyError:
            raise ConfigError(
                f"{self.config_key} = {name!r}: unknown {self.kind}; registered: {sorted(self._fns)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._fns))

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
