"""The options a shard gives the broker it autostarts: no spare group its tests cannot use.

Why: a broker keeps one clean *spare* group per recently used spec, so that a group that must
be replaced (a hang, a crash, a task-count bound, changed code) is replaced at once. That
pays in an interactive loop, where code changes; a CI shard runs its share once, with fixed
code, and its spare started on every node and never ran a task (6.9 s of spawning per node,
cores and GPUs taken from the shard's own tests while it started). A shard knows its share
before anything autostarts the broker (the warm-up after collection does), so it decides:

* a spare is kept where the shard's own tests will use one: a spec with more tests in the
  share than the broker's ``--max-tasks-per-group`` bound (a group of it is certain to be
  replaced, and the spare takes its next test);
* otherwise the broker gets ``--spares 0``; a group lost to a hang or a crash then costs
  that spec's next test one spawn, as it would with no warm pool;
* a ``--spares`` the user put in ``CPQ_BROKER_ARGS`` is theirs and wins.

The broker reads ``CPQ_BROKER_ARGS`` when the plugin autostarts it; a broker that already
runs keeps its own options. docs/fanout.md, "Slurm", lists the variable.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Iterable, MutableMapping

#: The variable whose shell words the autostarted broker gets (``cpq.client.autostart``).
BROKER_ARGS_VAR = "CPQ_BROKER_ARGS"


def _option(words: list[str], name: str) -> str | None:
    """The value of ``--name V`` / ``--name=V`` in ``words`` (the last one), else None."""
    found = None
    for n, word in enumerate(words):
        if word == name and n + 1 < len(words):
            found = words[n + 1]
        elif word.startswith(name + "="):
            found = word.split("=", 1)[1]
    return found


def spare_used(words: list[str], specs: Iterable[str | None]) -> bool:
    """Whether a spare would take a task of this share: some spec has more tests than
    ``--max-tasks-per-group`` lets one group run (0 or absent: no bound)."""
    try:
        bound = int(_option(words, "--max-tasks-per-group") or 0)
    except ValueError:
        return True  # the broker will refuse it; do not add to the confusion
    counts = Counter(spec for spec in specs if spec is not None)
    return bound > 0 and any(n > bound for n in counts.values())


def configure_spares(env: MutableMapping[str, str], specs: Iterable[str | None]) -> bool:
    """Add ``--spares 0`` to ``env``'s broker options unless the user chose ``--spares`` or
    the share (the pool spec of each test it keeps; None: no group) would use a spare.
    True when it was added."""
    current = env.get(BROKER_ARGS_VAR, "")
    try:
        words = shlex.split(current)
    except ValueError:
        return False  # unbalanced quotes: the autostart reports it, with the variable named
    if _option(words, "--spares") is not None or spare_used(words, specs):
        return False
    env[BROKER_ARGS_VAR] = f"--spares 0 {current}".strip()
    return True
