"""A probe pytest plugin: what a pytest process imports before its ``pytest_configure`` (the
conftests' phase) and what each import costs, appended to ``$IMPORTPROBE_LOG`` (default
``/tmp/ip.log``) with the process's pid. Used for "What the warm caller's fork imports"
(BENCHMARKS.md): the fork of a warm caller imports there what the warm caller left out.

Usage as ``tools/gpu/hooktime.py``'s: copy it onto the import path of every process, then
``PYTEST_ADDOPTS="-p importprobe"``. Each module's own time is its loading (``create_module``
and ``exec_module``, where cpq's hand-over of modules imported ahead happens) less that of
the modules it imported meanwhile; CUDA's initialisation (``torch.cuda._lazy_init``) is
reported on its own.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

_LOG = os.environ.get("IMPORTPROBE_LOG", "/tmp/ip.log")
_own: dict[str, float] = {}  # module -> its own seconds
_stack: list[list[float]] = []  # per module being loaded: [started, children's seconds]
_cuda: list[float] = []
_started = time.perf_counter()


def _timed(name: str, call: Any, *args: Any) -> Any:
    _stack.append([time.perf_counter(), 0.0])
    try:
        return call(*args)
    finally:
        started, children = _stack.pop()
        took = time.perf_counter() - started
        _own[name] = _own.get(name, 0.0) + took - children
        if _stack:
            _stack[-1][1] += took


class _Loader:
    def __init__(self, real: Any, name: str) -> None:
        self._real, self._name = real, name

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._real, "create_module", None)
        return None if create is None else _timed(self._name, create, spec)

    def exec_module(self, module: Any) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._real
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._real
        _timed(self._name, self._real.exec_module, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Finder:
    delegates_to_meta_path = True  # cpq's imports ahead skip it when they resolve a name

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


_FINDER = _Finder()
sys.meta_path.insert(0, _FINDER)


def _wrap_cuda() -> None:
    cuda = sys.modules.get("torch.cuda")
    real = getattr(cuda, "_lazy_init", None)
    if real is None or getattr(real, "_probed", False):
        return

    def lazy_init() -> Any:
        started = time.perf_counter()
        try:
            return real()
        finally:
            _cuda.append(time.perf_counter() - started)

    lazy_init._probed = True  # type: ignore[attr-defined]
    cuda._lazy_init = lazy_init  # type: ignore[union-attr]


_wrap_cuda()


def pytest_load_initial_conftests(early_config: Any, parser: Any, args: Any) -> None:
    _wrap_cuda()  # torch may be imported by now (a fork has it loaded from its start)


def pytest_configure(config: Any) -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    total = sum(_own.values())
    by_family: dict[str, list[float]] = {}
    for name, own in _own.items():
        family = ".".join(name.split(".")[:2])
        entry = by_family.setdefault(family, [0.0, 0.0])
        entry[0] += own
        entry[1] += 1
    lines = [
        f"pid={os.getpid()} ppid={os.getppid()} argv={' '.join(sys.argv)[:60]} "
        f"since the probe: {time.perf_counter() - _started:.2f} s; {len(_own)} modules loaded, "
        f"{total:.2f} s; CUDA init {sum(_cuda):.2f} s ({len(_cuda)} calls, the first counted)"
    ]
    for family, (own, count) in sorted(by_family.items(), key=lambda kv: -kv[1][0])[:25]:
        lines.append(f"  family {family}: {own:.3f} s, {int(count)} modules")
    for name, own in sorted(_own.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"  module {name}: {own:.3f} s")
    with open(_LOG, "a") as handle:
        handle.write("\n".join(lines) + "\n")
