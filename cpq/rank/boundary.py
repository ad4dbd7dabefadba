"""The module boundary between calling sessions and around launches (docs/design.md,
"Fidelity: the session boundary").

A fresh ``torchrun -m pytest`` session, or a fresh ``torchrun script.py`` launch, is a new
process: it imports the project's modules and the libraries its code uses afresh, so module
state (``PartialState._shared_state`` in accelerate, a list a project module appends to)
starts empty. A warm rank keeps every module it ever imported. So when a rank finishes one
calling session, and after every launch, :func:`cross` forgets the modules that were not
loaded when the rank became ready: the next session imports them afresh, as a new process
would. What the group loaded before it was ready (cpq, torch, ``CPQ_PRELOAD``) stays warm —
that is the warmth — and a preloaded library whose state cpq knows is reset explicitly
(:func:`_reset_known_libraries`).

Not every module can be imported twice in one process. A family of modules (a top-level
name and everything under it) that was not loaded at ready is forgotten whole, unless:

* it is a **submodule of a family loaded at ready** (``torch._dynamo`` loaded lazily by a
  test): its parent keeps it as an attribute and other modules hold its classes; a second
  copy would break ``isinstance`` and register torch's operators twice;
* it is the **standard library** (fresh imports of ``multiprocessing`` or ``concurrent``
  would lose the state their atexit hooks and threads refer to), cpq's own, or pytest and
  pluggy (the harness: pytest is written to run many sessions in one process);
* it holds an **extension module** (numpy refuses a second load; a single-phase extension
  keeps its state anyway), or has no module backed by a file (nothing to import afresh);
* it **registered torch operators or kernels** (``torch.library``, ``custom_op``): a second
  import raises "Only a single TORCH_LIBRARY can be used to register the namespace"; the
  owner is read from torch's own record of where each operator was registered;
* a module that stays **refers to it** at module level (``import X`` or ``from X import
  f``): that module would go on using the old copy while new imports get a new one.

Forgetting a module never breaks what still refers to it (objects keep their modules
alive); it only makes the next ``import`` execute the module again. With the modules go what
belongs to them: their loggers, their import hooks in ``sys.meta_path``, and ``sys.path``,
``warnings.filters``, the ``sys`` hooks and the signal handlers as they were at ready. The
code check (:mod:`cpq.rank.freshness`) stops watching the files of forgotten modules: an
edit of the project's code between sessions needs no fresh group any more.

Other parts of the boundary (torch's global switches, GPU memory) register a step with
:func:`add_step`; :func:`cross` runs them after the modules are forgotten.

Cost: nothing per test; at a boundary a walk of ``sys.modules`` and the globals of the
modules that stay and were loaded after ready, and torch's operator names (~10 ms with
torch; ``tools/bench_torchrun.py`` measures launches).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import os
import re
import signal
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Any

from cpq.rank import exits, probes

log = logging.getLogger("cpq.rank")

#: Families that stay loaded whatever was imported when: cpq itself, the pytest harness, and
#: the process's main module, also under multiprocessing's name for it (``import torch``
#: registers ``__mp_main__``: held aside by a warm caller, it "resolved elsewhere" in every
#: session, which then dropped all that was imported ahead).
HARNESS = frozenset(
    {"cpq", "pytest", "_pytest", "pluggy", "iniconfig", "py", "__main__", "__mp_main__"}
)
_EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)
_REGISTERED_AT = re.compile(r"registered at (.+?):\d+")

Step = Callable[[], None]
Listener = Callable[[dict[str, str]], None]


@dataclass
class _Ready:
    """What the rank had loaded and set when it became ready."""

    modules: frozenset[str]
    families: frozenset[str]
    path: list[str]
    meta_path: list[Any]
    path_hooks: list[Any]
    filters: list[Any]
    hooks: dict[str, Any]
    thread_hook: Any
    signals: dict[int, Any]
    ops: frozenset[str]
    impls: frozenset[str]


@dataclass
class Crossed:
    """What one crossing did (for the log and the tests)."""

    forgotten: dict[str, str] = field(default_factory=dict)  # module -> its file ("")
    #: family -> why it stays, for the families loaded after ready that were kept.
    kept: dict[str, str] = field(default_factory=dict)
    #: Forgotten families whose every module a plain file loader executed (no assertion
    #: rewriting, no custom loader): what :mod:`cpq.rank.ahead` may import again.
    plain: set[str] = field(default_factory=set)
    seconds: float = 0.0


@dataclass
class Detached:
    """Families taken out of ``sys.modules`` whole, with what belongs to them: kept by
    :mod:`cpq.rank.ahead` until a session imports them (then put back as they were)."""

    modules: dict[str, Any] = field(default_factory=dict)  # name -> module, import order
    loggers: dict[str, Any] = field(default_factory=dict)
    #: (where it stood, the hook): put back at its place.
    meta_path: list[tuple[int, Any]] = field(default_factory=list)
    path_hooks: list[tuple[int, Any]] = field(default_factory=list)


_ready: _Ready | None = None
_steps: list[Step] = []
_listeners: list[Listener] = []
#: ``len(sys.modules)`` after the last crossing: an equal length means nothing to forget.
_settled_len = -1
#: The last crossing (None: none yet).
last: Crossed | None = None


def mark_ready() -> None:
    """Take the rank's ready state: what every later session starts from."""
    global _ready, _settled_len
    ops, impls = _torch_registrations()
    _ready = _Ready(
        modules=frozenset(sys.modules),
        families=frozenset(name.partition(".")[0] for name in sys.modules),
        path=list(sys.path),
        meta_path=list(sys.meta_path),
        path_hooks=list(sys.path_hooks),
        filters=list(warnings.filters),
        hooks=probes.sys_hooks(),
        thread_hook=threading.excepthook,
        signals=probes.signal_handlers(),
        ops=ops,
        impls=impls,
    )
    _settled_len = len(sys.modules)


def add_step(step: Step) -> Step:
    """Run ``step()`` at every crossing, after the modules are forgotten."""
    if step not in _steps:
        _steps.append(step)
    return step


def on_forget(listener: Listener) -> None:
    """Call ``listener({module: file})`` with what each crossing forgot."""
    if listener not in _listeners:
        _listeners.append(listener)


def cross(why: str = "session") -> Crossed:
    """The session (or launch) boundary: forget what was imported since ready, restore
    what belongs to it, run the registered steps. Call from the main thread."""
    global _settled_len, last
    started = time.perf_counter()
    crossed = Crossed()
    if _ready is None:  # not ready yet (a unit test): nothing to go back to
        return crossed
    if len(sys.modules) != _settled_len:
        crossed = _forget(_ready)
    try:  # as a fresh process's exit would
        exits.run_forgotten(crossed.forgotten, sys.modules)
    except Exception:  # a session's handler must not stop the boundary
        log.exception("running the session's atexit handlers failed")
    _restore(_ready)
    _reset_known_libraries(_ready)
    for step in _steps:
        try:
            step()
        except Exception:
            log.exception("a session boundary step failed")
    _settled_len = len(sys.modules)
    crossed.seconds = time.perf_counter() - started
    if crossed.forgotten:
        log.info(
            "%s boundary: forgot %d modules (%s) in %.1f ms; kept %s",
            why,
            len(crossed.forgotten),
            ", ".join(sorted({n.partition(".")[0] for n in crossed.forgotten}))[:300],
            crossed.seconds * 1000,
            "; ".join(f"{k}: {v}" for k, v in sorted(crossed.kept.items()))[:600] or "nothing",
        )
    if crossed.forgotten:
        for listener in _listeners:
            listener(crossed.forgotten)
    last = crossed
    return crossed


# ------------------------------------------------------------------------- which modules


def _file(module: Any) -> str:
    path = getattr(module, "__file__", None)
    return path if isinstance(path, str) else ""


def _is_extension(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    if isinstance(getattr(spec, "loader", None), importlib.machinery.ExtensionFileLoader):
        return True
    return _file(module).endswith(_EXTENSIONS)


def _candidates(ready: _Ready) -> tuple[dict[str, list[str]], dict[str, str], list[str]]:
    """``(families that may go -> their modules, kept families -> why, modules that stay
    although loaded after ready)``."""
    families: dict[str, list[str]] = {}
    kept: dict[str, str] = {}
    staying: list[str] = []
    stdlib: frozenset[str] = getattr(sys, "stdlib_module_names", frozenset())
    for name in list(sys.modules):
        if name in ready.modules:
            continue
        top = name.partition(".")[0]
        if top in ready.families or top in HARNESS or top in stdlib:
            staying.append(name)
            continue
        families.setdefault(top, []).append(name)
    for top, names in list(families.items()):
        modules = [sys.modules.get(n) for n in names]
        why = ""
        if any(_is_extension(m) for m in modules if m is not None):
            why = "holds an extension module"
        elif not any(_file(m) for m in modules if m is not None):
            why = "no module of it has a file"
        if why:
            kept[top] = why
            staying.extend(families.pop(top))
    return families, kept, staying


def _registered_files(ready: _Ready) -> tuple[set[str], set[str]]:
    """``(files, modules)`` that registered torch operators or kernels since ready."""
    ops, impls = _torch_registrations()
    new_ops, new_impls = ops - ready.ops, impls - ready.impls
    files: set[str] = set()
    modules: set[str] = set()
    if not new_ops and not new_impls:
        return files, modules
    torch = sys.modules["torch"]
    opdefs = getattr(sys.modules.get("torch._library.custom_ops"), "OPDEFS", {})
    names = set(new_ops)
    for key in new_impls:  # "namespace/op[.overload]/DispatchKey"
        namespace, _, rest = key.partition("/")
        names.add(f"{namespace}::{rest.rpartition('/')[0]}")
    for name in names:
        opdef = opdefs.get(name)
        init = getattr(opdef, "_init_fn", None)
        if init is not None:
            modules.add(str(getattr(init, "__module__", "")))
        try:
            dump = torch._C._dispatch_dump(name)
        except Exception:  # an overload name torch does not resolve: nothing to read
            continue
        files.update(os.path.realpath(m) for m in _REGISTERED_AT.findall(dump))
    return files, modules


def _referenced_families(names: Iterable[str], families: dict[str, list[str]]) -> set[str]:
    """The families among ``families`` that the modules ``names`` refer to at module level."""
    return references((sys.modules.get(name) for name in names), families)


def references(modules: Iterable[Any], tops: Container[str]) -> set[str]:
    """The top-level names among ``tops`` whose modules ``modules`` refer to at module level
    (``import X``, ``from X import f``)."""
    found: set[str] = set()
    with warnings.catch_warnings():  # looking warns for some (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        for module in modules:
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for value in list(namespace.values()):
                owner: Any = (
                    value.__name__
                    if isinstance(value, types.ModuleType)
                    else getattr(value, "__module__", None)
                )
                if not isinstance(owner, str):
                    continue
                top = owner.partition(".")[0]
                if top in tops:
                    found.add(top)
    return found


def _select(ready: _Ready) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``(families that go -> their modules, kept families -> why)``."""
    families, kept, staying = _candidates(ready)
    if families:
        files, registrants = _registered_files(ready)
        owners = {m.partition(".")[0] for m in registrants} & set(families)
        if files:  # which family each registering file belongs to
            for top, names in families.items():
                if any(os.path.realpath(_file(sys.modules.get(n))) in files for n in names):
                    owners.add(top)
        for top in owners:
            kept[top] = "registered torch operators (a second import would register them again)"
            staying.extend(families.pop(top))
    # A module that stays and refers to a family keeps it, and what that family refers to.
    scan = staying
    while families and scan:
        referenced = _referenced_families(scan, families)
        scan = []
        for top in referenced:
            kept[top] = "a module that stays refers to it"
            scan.extend(families.pop(top))
    return families, kept


def _plain(module: Any) -> bool:
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    if loader is None:  # a namespace package of an older Python
        return getattr(module, "__path__", None) is not None
    return type(loader) in _PLAIN_LOADERS or type(loader).__name__ == "NamespaceLoader"


_PLAIN_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)


def _forget(ready: _Ready) -> Crossed:
    families, kept = _select(ready)
    crossed = Crossed(kept=kept)
    crossed.plain = {
        top
        for top, names in families.items()
        if all(_plain(sys.modules.get(name)) for name in names)
    }
    for names in families.values():
        for name in names:
            crossed.forgotten[name] = _file(sys.modules.pop(name, None))
    _forget_loggers(set(families))
    _forget_hooks(set(families))
    return crossed


def detach() -> Detached:
    """Take what :func:`cross` would forget now out of ``sys.modules`` whole — modules,
    loggers, import hooks — and hand it over instead of dropping it."""
    detached = Detached()
    if _ready is None:
        return detached
    families, _ = _select(_ready)
    tops = set(families)
    for name in list(sys.modules):
        if name.partition(".")[0] in tops:
            detached.modules[name] = sys.modules.pop(name)
    manager = logging.Logger.manager
    with _logging_lock():
        for name in list(manager.loggerDict):
            if name.partition(".")[0] in tops:
                detached.loggers[name] = manager.loggerDict.pop(name)
        clear = getattr(manager, "_clear_cache", None)
        if clear is not None:
            clear()
    detached.meta_path = [(i, h) for i, h in enumerate(sys.meta_path) if owner_top(h) in tops]
    detached.path_hooks = [(i, h) for i, h in enumerate(sys.path_hooks) if owner_top(h) in tops]
    _forget_hooks(tops)
    return detached


def attach(detached: Detached) -> None:
    """Put what :func:`detach` took back, as it was."""
    sys.modules.update(detached.modules)
    manager = logging.Logger.manager
    with _logging_lock():
        manager.loggerDict.update(detached.loggers)
        clear = getattr(manager, "_clear_cache", None)
        if clear is not None:
            clear()
    pairs = ((sys.meta_path, detached.meta_path), (sys.path_hooks, detached.path_hooks))
    for hooks, taken in pairs:
        for index, hook in taken:
            if hook not in hooks:
                hooks.insert(index, hook)
    if detached.path_hooks:  # the finders cached per folder were made without them
        sys.path_importer_cache.clear()


def _forget_loggers(families: set[str]) -> None:
    """A fresh process has no logger of a library it has not imported yet (no level, no
    handler a script added)."""
    if not families:
        return
    manager = logging.Logger.manager
    with _logging_lock():
        for name in list(manager.loggerDict):
            if name.partition(".")[0] in families:
                del manager.loggerDict[name]
        clear = getattr(manager, "_clear_cache", None)
        if clear is not None:
            clear()


def _logging_lock() -> Any:
    acquire = getattr(logging, "_acquireLock", None)
    release = getattr(logging, "_releaseLock", None)

    class _Lock:
        def __enter__(self) -> None:
            if acquire is not None:
                acquire()

        def __exit__(self, *exc: object) -> None:
            if release is not None:
                release()

    return _Lock()


def _forget_hooks(families: set[str]) -> None:
    """Import hooks a forgotten library installed go with it (its next import installs
    them again)."""
    if not families:
        return

    def mine(hook: Any) -> bool:
        owner = getattr(hook, "__module__", None) or getattr(type(hook), "__module__", "")
        return isinstance(owner, str) and owner.partition(".")[0] in families

    sys.meta_path[:] = [h for h in sys.meta_path if not mine(h)]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not mine(h)]


# --------------------------------------------------------------------- what goes with them


def _restore(ready: _Ready) -> None:
    """``sys.path``, the warning filters, the ``sys`` hooks and the signal handlers as at
    ready: a fresh process starts with them."""
    if sys.path != ready.path:
        sys.path[:] = ready.path
    for hook in list(sys.meta_path):  # hooks added since ready by what stays are kept
        if hook in ready.meta_path or getattr(hook, "keep_across_boundary", False):
            continue
        if owner_top(hook) in HARNESS:
            sys.meta_path.remove(hook)  # pytest's assertion rewriter of a finished session
    if warnings.filters != ready.filters:
        warnings.filters[:] = ready.filters  # type: ignore[index]
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()
    for name, hook in ready.hooks.items():
        if getattr(sys, name) is not hook:
            setattr(sys, name, hook)
    if threading.excepthook is not ready.thread_hook:
        threading.excepthook = ready.thread_hook
    if threading.current_thread() is threading.main_thread():
        for number, handler in ready.signals.items():
            if handler is not None and signal.getsignal(number) is not handler:
                with contextlib.suppress(OSError, ValueError, TypeError):
                    signal.signal(number, handler)


def owner_top(hook: Any) -> str:
    owner = getattr(hook, "__module__", None) or getattr(type(hook), "__module__", "")
    return owner.partition(".")[0] if isinstance(owner, str) else ""


def _reset_known_libraries(ready: _Ready) -> None:
    """Libraries the group preloaded stay loaded; the process-wide state cpq knows of them
    goes back to a fresh import's. accelerate: its shared ``PartialState``,
    ``AcceleratorState`` and ``GradientState`` (what its own tests reset between cases)."""
    state = sys.modules.get("accelerate.state")
    if state is None or "accelerate" not in ready.families:
        return
    for name in ("AcceleratorState", "PartialState", "GradientState"):
        kind = getattr(state, name, None)
        reset = getattr(kind, "_reset_state", None)
        if reset is None:
            continue
        try:
            if name == "AcceleratorState":
                reset(True)
            else:
                reset()
        except Exception:
            log.exception("resetting accelerate's %s failed", name)


def _torch_registrations() -> tuple[frozenset[str], frozenset[str]]:
    """torch's operator names and the kernels registered from Python (empty without torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return frozenset(), frozenset()
    try:
        ops = frozenset(torch._C._dispatch_get_all_op_names())
    except Exception:
        ops = frozenset()
    library = sys.modules.get("torch.library")
    return ops, frozenset(getattr(library, "_impls", ()))
