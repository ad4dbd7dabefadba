"""Imports ahead of a session (cpq/rank/ahead.py) on this interpreter's own modules: what a
session imported is imported again after the boundary, kept out of sight, and handed over
when imported — with a fresh import's state — or dropped where a fresh import would differ.
No process, no socket: the boundary and the warm-up run in this process."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cpq.rank import ahead, boundary, importenv, warnfilters

NAMES = (
    *("aproj", "aproj.sub", "aquiet", "aother", "athread", "acustom", "ahook", "abroken"),
    "asay",
    "aregisters",
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package with state, a variable read at import and a submodule; a module setting a
    warning filter; one referring to the package; one starting a thread. The boundary's
    ready state is taken before any is imported."""
    (tmp_path / "aproj").mkdir()
    (tmp_path / "aproj" / "__init__.py").write_text(
        "import os\nMODE = os.environ.get('APROJ_MODE', 'unset')\nSEEN = []\n"
    )
    (tmp_path / "aproj" / "sub.py").write_text("VALUE = 1\n")
    (tmp_path / "aquiet.py").write_text(
        "import warnings\nwarnings.filterwarnings('ignore', message='aquiet is quiet')\n"
    )
    (tmp_path / "aother.py").write_text("import aproj\n")
    (tmp_path / "athread.py").write_text(
        "import threading\nstop = threading.Event()\n"
        "threading.Thread(target=stop.wait, daemon=True).start()\n"
    )
    (tmp_path / "asay.py").write_text(
        "import warnings\nprint('asay says hello')\n"
        "warnings.warn('asay is old', DeprecationWarning)\n"
    )
    (tmp_path / "abroken.py").write_text(f"open({str(tmp_path / 'needed.txt')!r}).read()\n")
    (tmp_path / "ahook.py").write_text(
        "import sys\nclass Hook:\n    def find_spec(self, name, path=None, target=None):\n"
        "        return None\nsys.meta_path.insert(0, Hook())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("APROJ_MODE", raising=False)
    monkeypatch.delenv(ahead.ENV, raising=False)
    saved = boundary._ready, boundary._settled_len
    importenv.install()
    importenv.start_done()
    boundary.mark_ready()
    yield tmp_path
    thread = sys.modules.get("athread")
    if thread is not None:
        thread.stop.set()
    ahead.drop("the test ended")
    ahead._plan = None
    ahead.refused.clear()
    ahead._fate.clear()
    for name in NAMES:
        sys.modules.pop(name, None)
    sys.meta_path[:] = [h for h in sys.meta_path if type(h).__module__ != "ahook"]
    importenv.uninstall()
    boundary._ready, boundary._settled_len = saved


def _session_ends() -> boundary.Crossed:
    """What the rank does when a session ended: cross, learn, warm."""
    crossed = boundary.cross("test")
    ahead.learn(crossed, list(sys.path), os.getcwd(), dict(os.environ))
    ahead.warm()
    return crossed


def test_a_session_takes_over_what_the_last_imported_with_a_fresh_imports_state(
    project: Path,
) -> None:
    import aproj
    import aproj.sub

    aproj.SEEN.append(1)
    _session_ends()
    assert "aproj" not in sys.modules and "aproj.sub" not in sys.modules  # out of sight
    assert ahead.held() == ["aproj"]
    import aproj as again  # the next session imports it

    assert again is not aproj and again.SEEN == []  # a fresh import's state
    assert sys.modules["aproj.sub"].VALUE == 1 and again.sub is sys.modules["aproj.sub"]
    assert again.__spec__.origin == str(project / "aproj" / "__init__.py")
    assert ahead.held() == [] and ahead._fate["taken over"] == 2


def test_a_probe_finds_the_module_without_loading_it(project: Path) -> None:
    import aproj  # noqa: F401

    _session_ends()
    spec = importlib.util.find_spec("aproj")
    assert spec is not None and spec.origin == str(project / "aproj" / "__init__.py")
    assert "aproj" not in sys.modules and ahead.held() == ["aproj"]


def test_an_edited_file_is_imported_afresh(project: Path) -> None:
    import aproj.sub  # noqa: F401

    _session_ends()
    (project / "aproj" / "sub.py").write_text("VALUE = 22\n")
    importlib.invalidate_caches()
    import aproj.sub as edited

    assert edited.VALUE == 22
    assert "sub.py changed" in str(ahead._fate["dropped"]) and ahead.held() == []


def test_a_variable_read_at_import_binds_when_taken_over_and_drops_when_it_differs(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APROJ_MODE", "a")
    import aproj  # noqa: F401

    importenv.bound.clear()
    importenv._expected.clear()
    _session_ends()
    assert "APROJ_MODE" not in importenv.bound  # imported ahead: bound by nobody yet
    import aproj as same

    assert same.MODE == "a" and importenv.bound["APROJ_MODE"] == "a"  # as its own import
    _session_ends()
    monkeypatch.setenv("APROJ_MODE", "b")
    import aproj as other

    assert other.MODE == "b"
    assert "APROJ_MODE" in str(ahead._fate["dropped"])


def test_a_part_is_handed_over_alone_with_the_filters_its_import_set(project: Path) -> None:
    import aproj  # noqa: F401
    import aquiet  # noqa: F401

    _session_ends()
    assert ahead.held() == ["aproj", "aquiet"]
    with warnings.catch_warnings():  # a test's capture: the filter is set inside it
        import aquiet as quiet  # noqa: F401

        assert any(f[1] and f[1].pattern == "aquiet is quiet" for f in warnings.filters)
    assert not any(f[1] and f[1].pattern == "aquiet is quiet" for f in warnings.filters)
    assert "aproj" not in sys.modules and ahead.held() == ["aproj"]  # not imported: waits


def test_a_part_brings_the_parts_its_modules_refer_to(project: Path) -> None:
    importlib.import_module("aproj")  # first: a part of its own
    importlib.import_module("aother")  # refers to it: a second part
    _session_ends()
    assert ahead.held() == ["aother", "aproj"]
    assert ahead._parts["aother"] is not ahead._parts["aproj"]
    import aother as other

    assert sys.modules["aproj"] is other.aproj  # one copy, as in a fresh process
    assert ahead.held() == []


def test_a_module_found_elsewhere_on_the_sessions_path_is_imported_from_there(
    project: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import aproj  # noqa: F401

    _session_ends()
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "aproj").mkdir()
    (elsewhere / "aproj" / "__init__.py").write_text("WHERE = 'elsewhere'\n")
    sys.path.insert(0, str(elsewhere))
    try:
        importlib.invalidate_caches()
        import aproj as found

        assert found.WHERE == "elsewhere"
        assert "resolves elsewhere" in str(ahead._fate["dropped"])
    finally:
        sys.path.remove(str(elsewhere))


def test_an_import_that_starts_a_thread_is_not_imported_ahead(project: Path) -> None:
    import athread

    athread.stop.set()
    _session_ends()
    assert "athread" not in sys.modules and ahead.held() == []
    assert ahead.refused["athread"] == "started a thread"
    import athread as again  # the session imports it itself

    again.stop.set()
    assert not ahead.pending()
    crossed = _session_ends()
    assert "athread" in crossed.forgotten and ahead.held() == []  # never again in this rank


def test_a_module_of_another_loader_is_never_planned(project: Path) -> None:
    class Loader(importlib.abc.Loader):
        def create_module(self, spec: Any) -> None:
            return None

        def exec_module(self, module: Any) -> None:
            module.__file__ = str(project / "acustom.py")

    spec = importlib.util.spec_from_loader("acustom", Loader())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["acustom"] = module
    spec.loader.exec_module(module)
    crossed = _session_ends()
    assert "acustom" in crossed.forgotten and "acustom" not in crossed.plain
    assert ahead.held() == []


def test_off_when_the_broker_says_so(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ahead.ENV, "0")
    import aproj  # noqa: F401

    crossed = boundary.cross("test")
    ahead.learn(crossed, list(sys.path), os.getcwd(), dict(os.environ))
    assert not ahead.pending()


def test_an_import_hook_goes_and_comes_back_with_its_module(project: Path) -> None:
    import ahook  # noqa: F401

    _session_ends()
    assert not [h for h in sys.meta_path if type(h).__module__ == "ahook"]  # out of sight
    import ahook as again

    assert isinstance(sys.meta_path[0], again.Hook)  # where its import put it


def test_the_filters_imports_add_are_replayed_as_their_calls_would_add_them() -> None:
    a, b, c, x, y = ("a",), ("b",), ("c",), ("x",), ("y",)
    assert warnfilters.delta([a, b, c], [b, a, c]) == ([b], [])  # added again: moved
    assert warnfilters.delta([a, b, c], [x, a, b, c, y]) == ([x], [y])  # append=True
    assert warnfilters.delta([a, b, c], [a, c]) is None  # one removed: not replayable
    assert warnfilters.delta([a, b], []) is None  # resetwarnings()
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for item in ("c", "b", "a"):
            warnings.filterwarnings("ignore", message=item)
        before = list(warnings.filters)
        warnfilters.replay([before[1]], [])  # "b" moved to the front
        assert [f[1].pattern for f in warnings.filters] == ["b", "a", "c"]


def test_a_family_whose_import_fails_ahead_is_left_to_the_session_alone(project: Path) -> None:
    (project / "needed.txt").write_text("here\n")
    importlib.import_module("abroken")  # the session imported it
    importlib.import_module("aproj")
    (project / "needed.txt").unlink()  # gone before the warm-up: its import fails there
    _session_ends()
    assert "FileNotFoundError" in ahead.refused["abroken"]
    assert ahead.held() == ["aproj"] and "abroken" not in sys.modules  # the rest is kept


def test_a_task_that_arrives_ends_the_warm_up_between_families(project: Path) -> None:
    importlib.import_module("aproj")
    importlib.import_module("aquiet")
    crossed = boundary.cross("test")
    ahead.learn(crossed, list(sys.path), os.getcwd(), dict(os.environ))
    asked: list[int] = []

    def task_waits() -> bool:  # a task arrives while the first family imports
        asked.append(1)
        return len(asked) > 1

    ahead.warm(task_waits)
    assert ahead.held() == ["aproj"] and "aquiet" not in sys.modules


def test_what_an_import_printed_and_warned_is_said_where_a_fresh_import_says_it(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module("asay")
    _session_ends()
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import asay  # noqa: F401
    assert [str(w.message) for w in caught] == ["asay is old"]
    assert caught[0].filename == str(project / "asay.py") and caught[0].lineno == 3
    assert capsys.readouterr().out == "asay says hello\n"


def test_an_import_time_warning_this_session_makes_an_error_fails_the_import(
    project: Path,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module("asay")
    _session_ends()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -W error: a fresh import raises
        with pytest.raises(DeprecationWarning, match="asay is old"):
            import asay
        assert "asay" not in sys.modules and ahead.held() == []
        with pytest.raises(DeprecationWarning):  # imported afresh: raises again
            import asay  # noqa: F401


def test_what_the_import_of_a_family_that_stays_warned_is_warned_again_on_request(
    project: Path,
) -> None:
    """A family that registered a torch operator stays in ``sys.modules`` (a second import
    would register it again), so no part says what its import warned: the warm caller's
    fork says it at its session's start (``say_staying``); a family held aside keeps its
    own warnings for its hand-over."""
    (project / "aregisters.py").write_text(
        "import warnings, torch\n"
        "warnings.warn('aregisters falls back', UserWarning)\n"
        "@torch.library.custom_op('cpqahead::twice', mutates_args=())\n"
        "def twice(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x * 2\n"
    )
    import torch  # noqa: F401  (loaded before: only the module's own import is planned)

    ahead.plan(["aregisters", "asay"], list(sys.path), os.getcwd(), dict(os.environ))
    ahead.warm()
    assert "aregisters" in sys.modules and ahead.held() == ["asay"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ahead.say_staying()
    assert [str(w.message) for w in caught] == ["aregisters falls back"]
    assert caught[0].filename == str(project / "aregisters.py")


def test_what_a_parts_import_kept_is_done_again_when_it_is_handed_over(project: Path) -> None:
    """The warm caller's blame found the import setting a variable and appending a folder
    to the path (torch.compile's, setuptools' shapes): the session gets both when it
    imports the part, not before, and an entry already on its path is not added twice."""
    import aproj

    _session_ends()
    kept = ahead.Kept({"APROJ_CACHE": "/tmp/aproj"}, ["/nonexistent/aproj_vendor", sys.path[0]])
    assert ahead.keep_at_hand_over("aproj", kept)
    path = list(sys.path)
    assert "APROJ_CACHE" not in os.environ and "/nonexistent/aproj_vendor" not in sys.path
    try:
        import aproj  # noqa: F401

        assert os.environ["APROJ_CACHE"] == "/tmp/aproj"
        assert sys.path == [*path, "/nonexistent/aproj_vendor"]
    finally:
        os.environ.pop("APROJ_CACHE", None)
