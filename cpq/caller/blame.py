"""Whose import did what a fork cannot take, and which modules need it: the warm caller's
one pass that finds every module to leave out (docs/design.md, "The warm caller").

A warm-up pass imports the plan's modules in order and, after each, looks at what the
process is now: the import path, the variables, the ``sys`` hooks, signal handlers, the root
logger, its threads, CUDA (:func:`snapshot`). Blaming the plan's entry for a change is too
coarse: an entry such as ``distutils.compat`` only imports ``setuptools``, whose own code
extends ``sys.path``; once ``setuptools`` is loaded, the next entry that needs it shows no
change, so each pass found one more entry and Megatron-LM's warm caller took five passes
(~50 s on the GPU host) before it served. Instead, while a pass runs, a :class:`Blame`

1. **blames the module whose own code was running** when the change happened: a finder
   first in ``sys.meta_path`` brackets the finding and the execution of every module the
   pass loads (setuptools' finder for ``distutils`` imports setuptools while it finds), and
   the process is looked at each time one starts or ends (the module then is the innermost
   whose body runs: a call into torch from a module's body is that module's doing);
2. **records who needs whom**: the module whose body runs needs what every import
   statement and ``importlib.import_module`` imports meanwhile (through
   ``builtins.__import__`` and that function, also a module loaded already, also from a
   function it calls) and every module executed meanwhile; a submodule needs its package;

so that :meth:`Blame.needing` names, in the same pass, every module that needs a blamed
one, directly or not. The next pass imports neither and is served. A dependency the record
cannot see (a module loaded already, imported from C, or through a reference to
``import_module`` taken before the pass) shows in the next pass: the blamed module runs
again there, under the module that needs it.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import importlib.util
import logging
import os
import signal
import sys
import threading
import types
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cpq.rank import probes

State = dict[str, Any]


def _environ() -> dict[bytes, bytes]:
    """The variables, undecoded (cheap); also where a module replaced ``os.environ``."""
    data = getattr(os.environ, "_data", None)
    return dict(data) if isinstance(data, dict) else encoded(dict(os.environ))


def encoded(environ: dict[str, str]) -> dict[bytes, bytes]:
    """Variables as :func:`snapshot` holds them (``os.environ``'s own bytes)."""
    return {os.fsencode(k): os.fsencode(v) for k, v in environ.items()}


def snapshot() -> State:
    """What an import may change that a fork cannot take or a hand-over cannot replay."""
    return {
        "sys.path": list(sys.path),
        "os.environ": _environ(),
        "the sys hooks": probes.sys_hooks(),
        "threading.excepthook": threading.excepthook,
        "signal handlers": probes.signal_handlers(),
        "the root logger": (logging.root.level, list(logging.root.handlers)),
        "started a thread": set(threading.enumerate()),
        "initialised CUDA": probes.cuda_initialised(),
    }


def changes(before: State, after: State) -> list[str]:
    """What changed from ``before`` to ``after``, in words ("changed sys.path")."""
    found = []
    for what, was in before.items():
        now = after[what]
        if what == "started a thread":
            if now - was:  # a thread that ended is no one's doing
                found.append(what)
        elif what == "initialised CUDA":
            if now and not was:
                found.append(what)
        elif now != was:
            found.append(f"changed {what}")
    return found


def put_back(before: State) -> None:
    """Put back what can be (all but threads and CUDA) as it was in ``before``."""
    from cpq.rank import reset  # the rank's one way of setting os.environ in place

    sys.path[:] = before["sys.path"]
    if _environ() != before["os.environ"]:
        reset.set_environ({os.fsdecode(k): os.fsdecode(v) for k, v in before["os.environ"].items()})
    for name, hook in before["the sys hooks"].items():
        setattr(sys, name, hook)
    threading.excepthook = before["threading.excepthook"]
    for number, handler in before["signal handlers"].items():
        if signal.getsignal(number) is not handler:
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(number, handler)
    level, handlers = before["the root logger"]
    logging.root.setLevel(level)
    logging.root.handlers[:] = handlers


@dataclass
class Replay:
    """What an import did that the process keeps and a fork can do again."""

    #: Variables set (undecoded name -> the value last set).
    environ: dict[bytes, bytes] = field(default_factory=dict)
    #: Entries appended to ``sys.path``, in order.
    path: list[str] = field(default_factory=list)


class Blame:
    """One pass's record: the modules blamed (name -> what its code did) and who needs whom."""

    def __init__(self, left_out: Container[str] = ()) -> None:
        self.blamed: dict[str, str] = {}
        #: modules left out by earlier passes that ran in this one, and where from
        self.ran_again: dict[str, str] = {}
        self._left_out = left_out
        self._needs: dict[str, set[str]] = {}  # importer -> what it imports
        self._running: list[str] = []  # the modules whose bodies run, innermost last
        self._wrappers: dict[int, Any] = {}  # id of a wrapper -> the function it wraps
        #: What a module's import did that the process keeps and a fork can do again
        #: (module -> its :class:`Replay`), and all of it together, in order.
        self.replays: dict[str, Replay] = {}
        self.environ_set: dict[bytes, bytes] = {}
        self.path_appended: list[str] = []
        self._last = snapshot()

    def look(self, fallback: str = "") -> None:
        """Blame what changed since the last look on the module running now (``fallback``
        when none runs: the plan's entry being imported) — but variables set (none removed)
        and entries appended to ``sys.path`` (none removed or moved) are noted as the
        module's :class:`Replay`: ``torch.compile`` sets ``TORCHINDUCTOR_CACHE_DIR`` where
        it is unset, setuptools appends its ``_vendor`` folder, and a fresh process keeps
        them from then on."""
        now = snapshot()
        who = self._running[-1] if self._running else fallback
        seen, replay = dict(self._last), Replay()
        was, environ = seen["os.environ"], now["os.environ"]
        if who and environ != was and was.keys() <= environ.keys():
            replay.environ = {k: v for k, v in environ.items() if was.get(k) != v}
            seen["os.environ"] = environ
        was_path, path = seen["sys.path"], now["sys.path"]
        if who and len(path) > len(was_path) and path[: len(was_path)] == was_path:
            replay.path = path[len(was_path) :]
            seen["sys.path"] = path
        found = changes(seen, now)
        if found and who:
            self.blamed.setdefault(who, "; ".join(found))
        if replay.environ or replay.path:
            mine = self.replays.setdefault(who, Replay())
            mine.environ.update(replay.environ)
            mine.path += [entry for entry in replay.path if entry not in mine.path]
            self.environ_set.update(replay.environ)
            self.path_appended += [e for e in replay.path if e not in self.path_appended]
        self._last = now

    def again(self) -> None:
        """Look from here on (after the caller put things back)."""
        self._last = snapshot()

    def needing(self) -> dict[str, str]:
        """Every module that needs a blamed one, directly or not (name -> the blamed one)."""
        needed_by: dict[str, set[str]] = {}
        for importer, imported in self._needs.items():
            for name in imported:
                needed_by.setdefault(name, set()).add(importer)
        origin = {name: name for name in self.blamed}
        queue = list(self.blamed)
        while queue:
            name = queue.pop()
            for importer in needed_by.get(name, ()):
                if importer not in origin:
                    origin[importer] = origin[name]
                    queue.append(importer)
        return {name: culprit for name, culprit in origin.items() if name not in self.blamed}

    def culprits(self) -> dict[str, set[str]]:
        """Every module that needs a blamed one, directly or not, with all the blamed ones
        it needs (:meth:`needing` names one): a module that needs only modules blamed for
        initialising CUDA can be imported by a session prepared ahead
        (:mod:`cpq.caller.prepared`); one that also needs the root logger's can not."""
        needed_by: dict[str, set[str]] = {}
        for importer, imported in self._needs.items():
            for name in imported:
                needed_by.setdefault(name, set()).add(importer)
        found: dict[str, set[str]] = {}
        for culprit in self.blamed:
            queue, seen = [culprit], {culprit}
            while queue:
                for importer in needed_by.get(queue.pop(), ()):
                    if importer not in seen:
                        seen.add(importer)
                        queue.append(importer)
            for name in seen - set(self.blamed):
                found.setdefault(name, set()).add(culprit)
        return found

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Bracket every module executed, and record every import statement, meanwhile."""
        finder = _Finder(self)
        real_import = builtins.__import__

        def traced(
            name: str,
            globals: dict[str, Any] | None = None,
            locals: Any = None,
            fromlist: Any = (),
            level: int = 0,
        ) -> Any:
            module = real_import(name, globals, locals, fromlist, level)
            try:
                self._record(name, globals, fromlist, level)
            except Exception as exc:  # never into the import it watches
                self._broke(exc)
            return module

        real_import_module = importlib.import_module

        def import_module(name: str, package: str | None = None) -> Any:
            module = real_import_module(name, package)
            if self._running:  # also a module loaded already: setuptools' distutils finder
                try:
                    absolute = importlib.util.resolve_name(name, package)
                    self._needs.setdefault(self._running[-1], set()).add(absolute)
                except Exception as exc:  # never into the import it watches
                    self._broke(exc)
            return module

        functools.update_wrapper(traced, real_import)
        functools.update_wrapper(import_module, real_import_module)
        self._wrappers = {id(traced): real_import, id(import_module): real_import_module}
        sys.meta_path.insert(0, finder)
        builtins.__import__ = traced  # type: ignore[assignment]  # same call, a wider hint
        importlib.import_module = import_module
        try:
            yield
        finally:
            importlib.import_module = real_import_module
            builtins.__import__ = real_import
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(finder)

    def unwrap(self, modules: Iterable[Any]) -> None:
        """Put the real functions back where a module of the pass took a reference to a
        wrapper (``from importlib import import_module``): a fork must not call it."""
        for module in modules:
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for name, value in list(namespace.items()):
                real = self._wrappers.get(id(value))
                if real is not None:
                    namespace[name] = real

    def _record(self, name: str, globals: Any, fromlist: Any, level: int) -> None:
        """An import statement ran: the module whose body runs needs what it imports (also
        when a function of another module, called from that body, runs the statement: a
        function of torch's importing ``torch._dynamo`` when called is not torch's need)."""
        if not self._running:
            return  # no module's body runs: not an import's doing
        package = globals.get("__package__") if isinstance(globals, dict) else None
        try:
            target = importlib.util.resolve_name("." * level + name, package)
        except (ImportError, ValueError, TypeError, AttributeError):
            return
        needs = self._needs.setdefault(self._running[-1], set())
        needs.add(target)
        for each in fromlist if isinstance(fromlist, (list, tuple)) else ():
            if isinstance(each, str) and f"{target}.{each}" in sys.modules:
                needs.add(f"{target}.{each}")

    def _starting(self, name: str) -> None:
        try:
            self.look()  # what ran before this module's body is the enclosing module's doing
            if name in self._left_out and name not in self.ran_again:
                self.ran_again[name] = (
                    f"under {' > '.join(self._running[-3:])}"
                    if self._running
                    else _importing_code()
                )
            if self._running:
                self._needs.setdefault(self._running[-1], set()).add(name)
            parent = name.rpartition(".")[0]
            if parent:
                self._needs.setdefault(name, set()).add(parent)
        except Exception as exc:  # never into the import it watches
            self._broke(exc)
        self._running.append(name)

    def _ended(self) -> None:
        try:
            self.look()
        except Exception as exc:
            self._broke(exc)
        self._running.pop()

    def _broke(self, exc: Exception) -> None:
        """The record itself failed: the pass is not to be trusted (fail closed, ``"*"``)."""
        self.blamed.setdefault("*", f"the import record failed: {type(exc).__name__}: {exc}")


class _Finder:
    """First in ``sys.meta_path`` during a pass: finds as the finders after it do, and hands
    the import system a loader that brackets the module's execution."""

    #: It asks the other finders: one that asks every finder itself (``ahead._resolve``)
    #: skips it, or the two would ask each other for ever.
    delegates_to_meta_path = True

    def __init__(self, blame: Blame) -> None:
        self.blame = blame

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        # Finding runs code too: setuptools' finder for ``distutils`` imports setuptools
        # there. What a find imports and changes is the module found's.
        self.blame._starting(name)
        try:
            spec = self._find(name, path, target)
        finally:
            self.blame._ended()
        if spec is None:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            try:
                spec.loader = _bracketed(spec.loader, self.blame)
            except Exception as exc:  # the module loads as it would: not bracketed
                self.blame._broke(exc)
        return spec

    def _find(self, name: str, path: Any, target: Any) -> Any:
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    return spec
        return None


def _bracketed(real: Any, blame: Blame) -> Any:
    """``real``, its ``exec_module`` bracketed: an instance of a subclass of its class made
    here, with its attributes, so that code that looks at a spec it finds meanwhile
    (``importlib.util.find_spec(name).loader``: ``isinstance``, ``get_filename``) sees the
    loader it would see in a fresh process. A loader that is a class (builtins, frozen
    modules) or whose class takes no subclass is left as it is: what its modules do is
    then the enclosing module's."""
    cls = type(real)
    if isinstance(real, type) or not hasattr(real, "__dict__"):
        return real
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        try:
            sub = type(cls.__name__, (cls,), {"exec_module": _exec_bracketed})
        except TypeError:
            return real
        sub.__qualname__, sub.__module__ = cls.__qualname__, cls.__module__
        _SUBCLASSES[cls] = sub
    try:
        bracketed: Any = object.__new__(sub)
    except TypeError:  # a class with a base of C's own (a dict's subclass)
        return real
    bracketed.__dict__.update(real.__dict__)
    bracketed.__dict__["_cpq_real"], bracketed.__dict__["_cpq_blame"] = real, blame
    return bracketed


_SUBCLASSES: dict[type, type] = {}


def _exec_bracketed(self: Any, module: Any) -> None:
    """The subclass's ``exec_module``: the module and its spec get the real loader back
    before its body runs (nothing of the pass stays on them), and the body is bracketed."""
    real, blame = self.__dict__["_cpq_real"], self.__dict__["_cpq_blame"]
    spec = getattr(module, "__spec__", None)
    if spec is not None and spec.loader is self:
        spec.loader = real
    if getattr(module, "__loader__", None) is self:
        module.__loader__ = real
    blame._starting(spec.name if spec is not None else module.__name__)
    try:
        real.exec_module(module)
    finally:
        blame._ended()


def _importing_code() -> str:
    """Where the import was asked for when no module's body runs: the innermost frames
    outside the import system and this module."""
    frame: types.FrameType | None = sys._getframe(1)
    where: list[str] = []
    while frame is not None and len(where) < 3:
        name = frame.f_code.co_filename
        if not name.startswith("<frozen") and name != __file__:
            where.append(f"{name}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return "from " + " < ".join(where)
