"""Variables read while a group starts join its spec (docs/design.md "Fidelity").

torch, cpq and ``CPQ_PRELOAD`` read some variables while a group starts (``PYTORCH_JIT``,
``TORCHDYNAMO_*``, ...), before any task: a rank that finds a task's value of one of them
different from what its imports read refuses the task (``stale_start``). A fresh group of
the same spec would read the same value again, so instead the broker learns the name for
that spec and from then on widens every task of the spec with the caller's value of it:
the task gets a group started with the caller's value, as a fresh ``torchrun`` from the
caller's shell would be. A caller without the variable, on a group whose base environment
has it, cannot be matched (a spec cannot unset a variable): that stays an error.
"""

from __future__ import annotations

import dataclasses

from cpq.protocol import PoolSpec


class StartBound:
    """Per spec (as clients send it), the names its groups read at start-up."""

    def __init__(self) -> None:
        self.names: dict[PoolSpec, set[str]] = {}

    def learn(self, spec: PoolSpec, name: str) -> None:
        self.names.setdefault(spec, set()).add(name)

    def widen(self, spec: PoolSpec, env: dict[str, str] | None) -> PoolSpec:
        """``spec`` with the caller's values (``env``: the task's variables) of the names
        its groups read at start; ``spec`` itself when there is nothing to add."""
        names = self.names.get(spec)
        if not names or env is None:
            return spec
        pinned = {name for name, _ in spec.env}
        extra = [[name, env[name]] for name in sorted(names) if name in env and name not in pinned]
        if not extra:
            return spec
        return dataclasses.replace(spec, env=sorted([*spec.env, *extra]))
