"""The session boundary's rules (cpq/rank/boundary.py) on this interpreter's own modules,
and the spec's path lists folded (cpq/environ.py): no process, no socket."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from cpq import environ, specs
from cpq.rank import boundary


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A family of pure modules, one that a staying module refers to, and one referring to
    the standard library; the boundary's ready state taken before any is imported."""
    (tmp_path / "bproj").mkdir()
    (tmp_path / "bproj" / "__init__.py").write_text("SEEN = []\n")
    (tmp_path / "bproj" / "sub.py").write_text("import json\nVALUE = 1\n")
    (tmp_path / "bheld.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = boundary._ready, boundary._settled_len
    boundary.mark_ready()
    yield tmp_path
    for name in ("bproj", "bproj.sub", "bheld"):
        sys.modules.pop(name, None)
    boundary._ready, boundary._settled_len = saved


def test_what_was_imported_after_ready_is_forgotten_and_imported_afresh(project: Path) -> None:
    import bproj
    import bproj.sub

    bproj.SEEN.append(1)
    crossed = boundary.cross("test")
    assert {"bproj", "bproj.sub"} <= set(crossed.forgotten)
    assert "bproj" not in sys.modules and "json" in sys.modules  # the stdlib stays
    import bproj as again

    assert again.SEEN == [] and again is not bproj


def test_a_family_a_staying_module_refers_to_stays(project: Path) -> None:
    import bheld

    holder = type(sys)("json_holder_for_test")  # a stdlib-named family stays: it holds bheld
    holder.ref = bheld
    sys.modules["json.holder_for_test"] = holder
    try:
        crossed = boundary.cross("test")
        assert "bheld" in sys.modules
        assert crossed.kept["bheld"] == "a module that stays refers to it"
    finally:
        del sys.modules["json.holder_for_test"]


def test_sys_path_and_warning_filters_go_back_to_ready(project: Path) -> None:
    import warnings

    sys.path.append("/nowhere-for-test")
    warnings.simplefilter("ignore")
    boundary.cross("test")
    assert "/nowhere-for-test" not in sys.path
    assert warnings.filters == boundary._ready.filters  # type: ignore[union-attr]


def test_a_step_runs_at_every_crossing(project: Path) -> None:
    calls: list[int] = []
    step = boundary.add_step(lambda: calls.append(1))
    try:
        boundary.cross("test")
        boundary.cross("test")
    finally:
        boundary._steps.remove(step)
    assert calls == [1, 1]


def test_path_lists_are_folded_and_the_routing_folder_left_out() -> None:
    route = "/state/torchrun-route-abcd1234"
    serial = {"PYTHONPATH": f"{route}:/proj:/lib"}
    xdist = {"PYTHONPATH": f"{route}:{route}:/proj:/proj:/lib"}
    shell = {"PYTHONPATH": "/proj:/lib"}
    assert environ.split(serial)[0] == environ.split(xdist)[0] == environ.split(shell)[0]
    assert environ.fold_paths("/a:/b:/a") == "/a:/b"  # the first wins, as in a search
    # PYTHONPATH set to the routing folder where the shell had none: the shell's spec
    assert environ.split({"PYTHONPATH": route})[0] == environ.split({})[0] == {}
    assert environ.split({"PYTHONPATH": ""})[0] == {"PYTHONPATH": ""}  # the user's own


def test_default_roots_leave_the_routing_folder_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/s/torchrun-route-1", "/proj"]))
    roots = specs.default_roots()
    assert "/proj" in roots and not any("torchrun-route" in r for r in roots)


def test_a_family_that_registered_torch_operators_stays(project: Path) -> None:
    torch = pytest.importorskip("torch")
    assert torch is not None
    (project / "bops.py").write_text(
        textwrap.dedent(
            """
            import torch
            lib = torch.library.Library("cpq_boundary_test", "DEF")
            lib.define("noop(Tensor x) -> Tensor")
            """
        )
    )
    boundary.mark_ready()  # after torch: only bops is new
    import bops  # noqa: F401

    crossed = boundary.cross("test")
    assert "bops" in sys.modules and "operators" in crossed.kept["bops"]
    sys.modules.pop("bops", None)
