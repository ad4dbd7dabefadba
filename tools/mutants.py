#!/usr/bin/env python3
"""A short mutation check: each mutant is a one-line change a review found no test would
catch; the check applies it, runs the tests that must now fail, and restores the file.

    python tools/mutants.py            # every mutant; exit 1 if one survives
    python tools/mutants.py --list     # what each mutant breaks
    python tools/mutants.py liveness   # those whose name contains "liveness"

Run it when you touch one of the modules below (docs/design.md "Tests"). Each mutant names
the tests that catch it, so a run takes seconds, not the suite's minutes;
``tests/unit/test_mutants.py`` checks in CI that every mutant still applies to the code.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository
    original: str  # must occur exactly once in the file
    mutated: str
    tests: tuple[str, ...]  # pytest node ids or paths that must fail on the mutant


MUTANTS = (
    Mutant(
        "reset: the caller's environment never applied on a rank",
        "cpq/rank/reset.py",
        "    set_environ(environ_for(baseline, caller_env))\n",
        "    set_environ(dict(baseline.start_environ))\n",
        ("tests/unit/test_reset.py",),
    ),
    Mutant(
        "liveness: a deadlocked rank (CPU time standing still) counted as busy forever",
        "cpq/broker/liveness.py",
        "cpu > self.cpu_mark",
        "cpu >= self.cpu_mark",
        ("tests/unit/test_liveness.py",),
    ),
    Mutant(
        "verdicts: an error or unknown outcome from a rank makes a pass",
        "cpq/broker/verdicts.py",
        "    if unknown:\n        ranks = [r.rank for r in results if r.outcome in unknown]\n",
        "    if False:\n        ranks = [r.rank for r in results if r.outcome in unknown]\n",
        ("tests/unit/test_outcomes.py",),
    ),
    Mutant(
        "verdicts: a rank missing from the reports goes unnoticed",
        "cpq/broker/verdicts.py",
        "    if reported != list(range(world_size)):",
        "    if not reported:",
        ("tests/unit/test_outcomes.py",),
    ),
    Mutant(
        "wire: the decoder takes any outcome",
        "cpq/wirecheck.py",
        "if isinstance(value, str) and value in allowed:",
        "if isinstance(value, str):",
        ("tests/unit/test_wire.py",),
    ),
    Mutant(
        "broker: junk from a known rank keeps it alive",
        "cpq/broker/controller.py",
        "        group, rank = known\n        handler = self.rank_handlers.get(type(message))\n",
        "        group, rank = known\n        rank.last_seen = self.clock.monotonic()\n"
        "        handler = self.rank_handlers.get(type(message))\n",
        ("tests/unit/test_wire.py",),
    ),
    Mutant(
        "client: junk from the broker counts as a sign of life",
        "cpq/client/shared_socket.py",
        "            if self.on_frame(self.dealer.recv()):",
        "            if self.on_frame(self.dealer.recv()) or True:",
        ("tests/test_client_wire.py",),
    ),
    Mutant(
        "placement: a GPU one of this broker's groups holds counted as free",
        "cpq/broker/placement/plan.py",
        "        free = [g for g in usable if not users[g]]\n",
        "        free = list(usable)\n",
        ("tests/unit/test_placement.py::test_never_two_groups_on_one_gpu",),
    ),
    Mutant(
        "placement: busy CPU ranks not bounded by cores (--max-ranks)",
        "cpq/broker/placement/plan.py",
        "        return self.cores_used() + spec.world_size <= self.room.max_ranks\n",
        "        return True\n",
        ("tests/unit/test_placement.py::test_never_beyond_a_budget",),
    ),
    Mutant(
        "placement: a CPU group starts beyond --memory",
        "cpq/broker/placement/plan.py",
        "        return held + self.memory_need(spec) <= self.room.memory_mb or held <= 0\n",
        "        return True\n",
        ("tests/unit/test_placement.py::test_never_beyond_a_budget",),
    ),
    Mutant(
        "placement: a busy group may be evicted",
        "cpq/broker/placement/eviction.py",
        'if used and g.state == "idle" and g not in spares',
        'if used and g.state in ("idle", "busy") and g not in spares',
        ("tests/unit/test_placement.py::test_a_busy_group_is_never_interrupted",),
    ),
    Mutant(
        "placement: a younger CPU task takes the cores an older one waits for",
        "cpq/broker/placement/affinity.py",
        "(plan.cores_reserved or not plan.cores_free_for(spec))",
        "(not plan.cores_free_for(spec))",
        (
            "tests/unit/test_placement.py::test_a_wide_task_waiting_for_cores_is_not_passed_by_a_narrow_one",
            "tests/unit/test_placement.py::test_the_oldest_cpu_task_takes_cores_first",
        ),
    ),
    Mutant(
        "placement: every group recycled after its task (mixed world sizes thrash)",
        "cpq/broker/placement/recycling.py",
        "    if limit and group.tasks_done >= limit:\n",
        "    if group.tasks_done >= limit:\n",
        (
            "tests/unit/test_placement.py::test_a_repeating_mix_of_world_sizes_reaches_a_state_where_no_group_starts",
        ),
    ),
)


def apply(mutant: Mutant) -> str:
    """Write the mutant into its file; returns the original text to restore."""
    path = ROOT / mutant.path
    text = path.read_text()
    count = text.count(mutant.original)
    if count != 1:
        raise SystemExit(f"{mutant.name}: the original occurs {count} times in {mutant.path}")
    path.write_text(text.replace(mutant.original, mutant.mutated))
    return text


def caught(mutant: Mutant) -> bool:
    original = apply(mutant)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        (ROOT / mutant.path).write_text(original)
    return done.returncode == 1  # tests failed (not: collection error, usage error)


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for mutant in MUTANTS:
            print(f"{mutant.path}: {mutant.name}  [{' '.join(mutant.tests)}]")
        return 0
    chosen = [m for m in MUTANTS if not argv or any(a in m.name for a in argv)]
    survived = []
    for mutant in chosen:
        verdict = "caught" if caught(mutant) else "SURVIVED"
        print(f"{verdict:8}  {mutant.name}", flush=True)
        if verdict == "SURVIVED":
            survived.append(mutant)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutants caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
