"""``cpq-status`` stays readable: long spec labels and stop reasons cut, the names a group's
imports bound summarised (``--json`` keeps everything: it is the status document itself)."""

from __future__ import annotations

from cpq.client import render


def test_long_values_are_cut_and_lists_summarised() -> None:
    assert render.cut("x" * 500) == "x" * (render.MAX_CELL - 1) + "…"
    assert render.cut("short") == "short"
    names = [f"TORCHINDUCTOR_{i}" for i in range(300)]
    lines = render._bound_env([{"id": "g1", "bound_env": names, "start_bound_env": []}])
    assert lines[1:] == [
        "  g1: "
        + ", ".join(names[: render.MAX_NAMES])
        + f" +{300 - render.MAX_NAMES} more; 0 read while it started"
    ]
    assert lines[0].startswith("variables a group's imports read")
