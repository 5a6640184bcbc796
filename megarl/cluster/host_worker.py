"""Several roles in the same worker processes (colocation), built explicitly from role objects.

The hybrid actor keeps the training engine, the reference policy and the rollout engine in the
same processes so that resharding weights from trainer to rollout is local. `HostWorker` is
that process: it owns the rank's context and process groups, and holds one object per role,
built from `{role_name: (role_class, kwargs)}` as `role_class(context, **kwargs)`. Once all are
built, each role that defines `connect_roles(roles)` receives the dict of all role objects of
its process: that is how the rollout engine reaches the trainer's weights without leaving the
process.

The driver reaches a role through `WorkerGroup.for_role(name)`, which routes every call through
`HostWorker.call(role, method, ...)`. `set_active(roles)` offloads the roles that are not needed
(those with an `offload()` method) and then onloads the ones that are (`onload()`), in that order so
the memory is free before it is taken again; the trainer itself moves memory role by role around
each phase (`megarl.trainer.loop`, the roles' `onload`/`offload`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.cluster.worker import Worker, WorkerContext
from megarl.tracking.memory import memory_stats
from megarl.tracking.profiling import StepProfiler

RoleSpecs = dict[str, tuple[type, dict[str, Any]]]


class HostWorker(Worker):
    """A worker process hosting several role objects that share its rank and process groups."""

    def __init__(self, context: WorkerContext, roles: RoleSpecs) -> None:
        super().__init__(context)
        if not roles:
            raise ValueError(f"{context.role}: HostWorker needs at least one role")
        self.roles: dict[str, Any] = {}
        for name, (role_class, kwargs) in roles.items():
            self.roles[name] = role_class(context, **kwargs)
        for role in self.roles.values():
            if callable(getattr(role, "connect_roles", None)):
                role.connect_roles(self.roles)
        self.profiler: StepProfiler | None = None

    def role_names(self) -> list[str]:
        return list(self.roles)

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` of the role object `role` on this rank."""
        if role not in self.roles:
            raise KeyError(f"{self.context.role} rank {self.rank} hosts roles {list(self.roles)}, not {role!r}")
        target = getattr(self.roles[role], method, None)
        if target is None or not callable(target):
            raise AttributeError(f"role {role!r} ({type(self.roles[role]).__name__}) has no method {method!r}")
        return target(*args, **kwargs)

    def set_active(self, active: Sequence[str]) -> dict[str, str]:
        """Offload every role not in `active`, then onload those in it; report what was done.

        Roles without offload()/onload() are left alone. Returns {role: "offloaded"|"onloaded"}.
        """
        unknown = [name for name in active if name not in self.roles]
        if unknown:
            raise KeyError(f"set_active: unknown roles {unknown}; this worker hosts {list(self.roles)}")
        done: dict[str, str] = {}
        for name, role in self.roles.items():
            if name not in active and callable(getattr(role, "offload", None)):
                role.offload()
                done[name] = "offloaded"
        for name in active:
            role = self.roles[name]
            if callable(getattr(role, "onload", None)):
                role.onload()
                done[name] = "onloaded"
        return done

    def start_profile(self, step: int, out_dir: str) -> None:
        """Record everything this process runs until `stop_profile` (torch profiler)."""
        self.profiler = StepProfiler([step], out_dir, self.context.role, self.rank)
        self.profiler.start(step)

    def stop_profile(self) -> str | None:
        """Stop recording; the Chrome trace's path (`<out_dir>/step_<k>/<role>_rank<r>.json`)."""
        path = self.profiler.stop() if self.profiler is not None else None
        self.profiler = None
        return None if path is None else str(path)

    def memory_stats(self) -> dict[str, float]:
        """This process's memory now and its peaks since the last call (GiB; see tracking.memory)."""
        return memory_stats(reset=True)
