"""The warm caller's blame (cpq.caller.blame): in one pass over a plan, the module whose own
code changed the process is named, and so is every module that needs it; the modules
loaded keep their own loaders. Real imports of real files, in this process."""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpq.caller import blame

FILES = {
    # its own code puts a folder in front of the import path.
    "bl_pathy.py": "import sys\nsys.path.insert(0, '/nonexistent/bl_vendor')\n",
    "bl_alpha.py": "import bl_pathy\n",
    # needs bl_pathy after bl_alpha loaded it: no change shows, the import statement does.
    "bl_beta.py": "from bl_pathy import sys as _sys\n",
    "bl_clean.py": "import json\n",
    # a package whose submodule, loaded while the package runs, removes a variable through
    # a function of a module loaded already: the submodule's body is what ran.
    "bl_pkg/__init__.py": "from bl_pkg import setter\n",
    "bl_pkg/setter.py": "import bl_helpers\nbl_helpers.unset_it()\n",
    "bl_helpers.py": "import os\ndef unset_it():\n    del os.environ['BL_GONE']\n",
    # torch.compile's shape: a default set where the variable is unset, by every caller.
    "bl_default.py": (
        "import os\nif 'BL_CACHE' not in os.environ:\n    os.environ['BL_CACHE'] = '/tmp/bl'\n"
    ),
    "bl_defaults_too.py": "import bl_default, os\nos.environ.setdefault('BL_CACHE', 'other')\n",
    # setuptools' shape: a folder appended where it is missing, by each importer.
    "bl_appends.py": (
        "import sys\nif '/nonexistent/bl_end' not in sys.path:\n"
        "    sys.path.append('/nonexistent/bl_end')\n"
    ),
    "bl_appends_too.py": "import bl_appends, sys\nassert sys.path[-1] == '/nonexistent/bl_end'\n",
    "bl_user.py": "from bl_pkg import setter\n",
    # torch's shape: a function that imports a module when called (torch.compile and
    # torch._dynamo), called from another module's body.
    "bl_tool.py": "def use():\n    import bl_pathy\n",
    "bl_caller.py": "import bl_tool\nbl_tool.use()\n",
    "bl_found.py": "X = 1\n",
    "bl_refs.py": (
        "import builtins\nfrom importlib import import_module\nIMPORT = builtins.__import__\n"
    ),
}


class _ImportingFinder:
    """setuptools' shape: its finder for ``distutils`` imports setuptools while it finds."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "bl_found":
            importlib.import_module("bl_pathy")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("BL_GONE", "1")
    monkeypatch.delenv("BL_CACHE", raising=False)
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("bl_")]:
        del sys.modules[name]


def _pass(entries: list[str], left_out: tuple[str, ...] = ()) -> blame.Blame:
    """What the warm caller does: import each entry, look, put back (but the variables the
    imports set: later imports see them, as in a fresh process), go on."""
    record = blame.Blame(left_out)
    start = blame.snapshot()
    with record.watching():
        for name in entries:
            importlib.import_module(name)
            record.look(fallback=name)
            start["os.environ"].update(record.environ_set)
            start["sys.path"] += [e for e in record.path_appended if e not in start["sys.path"]]
            blame.put_back(start)
            record.again()
    return record


def test_one_pass_names_the_module_that_changed_the_path_and_all_that_need_it(
    project: Path,
) -> None:
    record = _pass(["bl_alpha", "bl_beta", "bl_clean"])
    assert record.blamed == {"bl_pathy": "changed sys.path"}
    needing = record.needing()
    assert needing["bl_alpha"] == needing["bl_beta"] == "bl_pathy"
    assert "bl_clean" not in needing and "json" not in needing
    assert "/nonexistent/bl_vendor" not in sys.path  # put back


def test_a_change_made_through_another_modules_function_is_the_running_modules(
    project: Path,
) -> None:
    record = _pass(["bl_pkg", "bl_user", "bl_clean"])
    assert record.blamed == {"bl_pkg.setter": "changed os.environ"}
    needing = record.needing()
    # the package ran it, bl_user imports it (loaded already): both need it
    assert needing["bl_pkg"] == needing["bl_user"] == "bl_pkg.setter"
    assert "bl_helpers" not in needing  # its function did it, its body did not
    assert os.environ["BL_GONE"] == "1"  # put back


def test_a_variable_an_import_sets_is_noted_not_blamed(project: Path) -> None:
    """A variable set (not removed) is the process's own, as in a fresh process: noted to be
    replayed in the fork, and no module is left out for it."""
    record = _pass(["bl_default", "bl_defaults_too", "bl_clean"])
    assert record.blamed == {}
    assert record.environ_set == {b"BL_CACHE": b"/tmp/bl"}  # the second found it set
    assert list(record.replays) == ["bl_default"]


def test_an_entry_an_import_appends_to_the_path_is_noted_not_blamed(project: Path) -> None:
    """An entry appended to ``sys.path`` (none removed or moved) is the process's own from
    then on, as in a fresh process: noted to be replayed, and no module is left out."""
    record = _pass(["bl_appends", "bl_appends_too", "bl_clean"])
    assert record.blamed == {}
    assert record.path_appended == ["/nonexistent/bl_end"]
    assert list(record.replays) == ["bl_appends"]
    assert record.replays["bl_appends"].path == ["/nonexistent/bl_end"]


def test_an_import_a_called_function_makes_is_the_running_modules_need(project: Path) -> None:
    record = _pass(["bl_caller", "bl_clean"])
    assert record.blamed == {"bl_pathy": "changed sys.path"}
    assert record.needing() == {"bl_caller": "bl_pathy"}  # not bl_tool: its import needs none


def test_a_left_out_module_that_runs_again_says_whose_import_ran_it(project: Path) -> None:
    record = _pass(["bl_alpha"], left_out=("bl_pathy",))
    assert record.ran_again == {"bl_pathy": "under bl_alpha"}


def test_what_a_finder_imports_while_it_finds_a_module_is_that_modules_need(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "meta_path", [_ImportingFinder(), *sys.meta_path])
    record = _pass(["bl_found", "bl_clean"])
    assert record.blamed == {"bl_pathy": "changed sys.path"}
    assert record.needing() == {"bl_found": "bl_pathy"}


def test_what_a_finder_imports_when_it_is_loaded_already_is_a_need_too(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "meta_path", [_ImportingFinder(), *sys.meta_path])
    record = _pass(["bl_alpha", "bl_found"])  # bl_alpha loads bl_pathy first
    assert record.needing() == {"bl_alpha": "bl_pathy", "bl_found": "bl_pathy"}


def test_the_modules_loaded_keep_their_own_loaders_and_the_hooks_go(project: Path) -> None:
    real_import, finders = builtins.__import__, list(sys.meta_path)
    _pass(["bl_clean", "bl_pkg"])
    for name in ("bl_clean", "bl_pkg", "bl_pkg.setter"):
        module = sys.modules[name]
        assert type(module.__loader__) is importlib.machinery.SourceFileLoader, name
        assert module.__spec__ is not None and module.__spec__.loader is module.__loader__
    assert builtins.__import__ is real_import
    assert sys.meta_path == finders


def test_a_spec_found_meanwhile_has_a_loader_of_its_kind(project: Path) -> None:
    """Code that finds a module during the pass sees the loader a fresh process would."""
    (project / "bl_probe.py").write_text(
        "import importlib.machinery, importlib.util\n"
        "SPEC = importlib.util.find_spec('bl_clean')\n"
        "KIND = isinstance(SPEC.loader, importlib.machinery.SourceFileLoader)\n"
        "FILE = SPEC.loader.get_filename('bl_clean')\n"
    )
    _pass(["bl_probe"])
    probe = sys.modules["bl_probe"]
    found_kind, found_file = probe.KIND, probe.FILE
    assert found_kind and found_file == os.fspath(project / "bl_clean.py")


def test_references_a_module_took_to_the_import_functions_are_the_real_ones_after(
    project: Path,
) -> None:
    real_import_module, real_import = importlib.import_module, builtins.__import__
    record = blame.Blame()
    with record.watching():
        importlib.import_module("bl_refs")
        taken = sys.modules["bl_refs"].import_module
        assert taken is not real_import_module and taken.__name__ == "import_module"
    record.unwrap([sys.modules["bl_refs"]])
    refs = sys.modules["bl_refs"]
    assert refs.import_module is real_import_module and refs.IMPORT is real_import


def test_the_record_never_raises_into_the_import_it_watches(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = blame.Blame()
    with record.watching():
        assert __import__("os", fromlist=1) is os  # what the interpreter takes, it takes
        monkeypatch.setattr(os, "environ", dict(os.environ))  # a module replaced it
        importlib.import_module("bl_clean")
    assert "bl_clean" in sys.modules and "*" not in record.blamed


def test_a_pass_that_changes_nothing_blames_nothing(project: Path) -> None:
    record = _pass(["bl_clean"])
    assert record.blamed == {} and record.needing() == {}


def test_a_change_outside_any_module_body_is_the_entrys() -> None:
    record = blame.Blame()
    start = blame.snapshot()
    with record.watching():
        sys.path.insert(0, "/nonexistent/bl_direct")
        record.look(fallback="the.entry")
        blame.put_back(start)
    assert record.blamed == {"the.entry": "changed sys.path"}
    assert "/nonexistent/bl_direct" not in sys.path
