"""What each process loads, checked in a fresh interpreter per process entry.

``tests/unit/test_imports.py`` reads the import statements; this runs them: a broker, a rank,
a client (the pytest plugin, ``cpq.Client``) and the merge each import their entry module
and report which ``cpq`` modules landed in ``sys.modules`` (docs/design.md "Module map").
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FOLDERS = ("cpq.broker", "cpq.rank", "cpq.client", "cpq.fanout")

ENTRIES = {
    # process: (code run at its start, the folders it may load)
    "broker": ("import cpq.broker.cli, cpq.broker.loop", {"cpq.broker"}),
    "rank": ("import cpq.rank.runtime, cpq.rank.launch", {"cpq.rank"}),
    "client": (
        "import cpq.client.plugin, cpq.client.cli; from cpq import Client, BadRequest",
        {"cpq.client", "cpq.fanout"},
    ),
    "merge": ("import cpq.fanout.cli", {"cpq.fanout"}),
}


def loaded_by(code: str) -> set[str]:
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'cpq')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def folder_of(module: str) -> str | None:
    return next((f for f in FOLDERS if module == f or module.startswith(f + ".")), None)


@pytest.mark.parametrize("process", sorted(ENTRIES))
def test_a_process_loads_only_its_own_folder_and_the_shared_leaves(process: str) -> None:
    code, allowed = ENTRIES[process]
    loaded = loaded_by(code)
    foreign = sorted(m for m in loaded if folder_of(m) not in (None, *allowed))
    assert not foreign, f"the {process} loaded {foreign}"
    assert any(folder_of(m) in allowed for m in loaded)  # the probe imported something


def test_the_package_alone_loads_nothing_else() -> None:
    assert loaded_by("import cpq") == {"cpq"}
