"""Rank side of the pytest plugin: run one marked test function inside a rank.

The plugin sends ``cpq.rank.pytest_task:run_test`` with the test file's path and the function's
qualified name. Loading the file by path (rather than importing the test module by name)
makes the ranks independent of pytest's import mode, and lets us compile it with pytest's
assertion rewriting so a failing ``assert a == b`` on a rank explains itself like it would
locally. A loaded file is cached until it changes on disk.
"""

from __future__ import annotations

import ast
import os
import sys
import types
from typing import Any

from cpq.rank import freshness, importenv

_cache: dict[str, tuple[tuple[int, int], types.ModuleType]] = {}


def _load(path: str, module_name: str) -> types.ModuleType:
    info = os.stat(path)
    stamp = (info.st_mtime_ns, info.st_size)
    cached = _cache.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    with open(path, "rb") as handle:
        source = handle.read()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, path, None)
    except ImportError:  # pytest missing in the rank: plain asserts still work
        pass
    code = compile(tree, path, "exec", dont_inherit=True)
    module = types.ModuleType(module_name)
    module.__file__ = path
    module.__package__ = module_name.rpartition(".")[0]  # relative imports in test packages
    sys.modules[module_name] = module
    freshness.reexecuted.add(module_name)  # re-executed here on change: not a stale module
    with importenv.importing():  # what pytest's import of it would be: its reads bind
        exec(code, module.__dict__)
    _cache[path] = (stamp, module)
    return module


def run_test(
    path: str, module: str, name: str, args: dict[str, Any], import_paths: list[str] | None = None
) -> Any:
    """Call test ``name`` (``func`` or ``Class.method``) of the file at ``path``.

    ``import_paths`` are the pytest process's own sys.path entries (rootdir, conftest and
    test directories); they are added here as pytest added them there, so a test's
    ``import helpers`` resolves on the ranks as it does locally.
    """
    for entry in reversed(import_paths or []):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    obj: Any = _load(path, module)
    parts = name.split(".")
    for index, part in enumerate(parts):
        obj = getattr(obj, part)
        if isinstance(obj, type) and index < len(parts) - 1:
            obj = obj()  # a test class: pytest makes one instance per test
    return obj(**args)
