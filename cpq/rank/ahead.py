"""Imports ahead of a session: what the project's last session imported, imported again while
the rank waits for the next one (docs/design.md, "Imports ahead of a session").

The session boundary (:mod:`cpq.rank.boundary`) forgets what a calling session imported, so
the next session imports it afresh, as a new process would — and pays for it: Megatron-LM's
root conftest imports ``megatron.core``, ~4 s on the GPU host, at every warm session's
start, while the test that waits for it is the session's first. A fresh group would pay it
at its start instead (the design: "groups a project starts next preload what its sessions
imported"). So when a session ends and the rank is fit to serve another, this module:

1. **learns** what the session imported and the boundary forgot — only families that plain
   file loaders executed (no assertion rewriting: pytest imports test modules and conftest
   files itself, with its own hook), in the order the session imported them;
2. **warms** (after the session's last report went out, the rank otherwise idle): imports
   them again, family by family in that order, in the session's environment, working
   directory and ``sys.path``. Each step is a *part*: the families it loaded, the variables
   its imports read (binding none, :func:`cpq.rank.importenv.diverted`), the warning
   filters and torch switches it set. Then every new module leaves ``sys.modules`` — with
   its loggers and import hooks (:func:`cpq.rank.boundary.detach`) — and everything else is
   put back: the rank is again exactly what the boundary left;
3. **hands a part over** when the next session imports one of its top-level names, at the
   moment a fresh process would execute it: a finder first in ``sys.meta_path`` checks that
   a fresh import would load the same thing — the same file found for the name on today's
   path, every file unchanged since, every variable the imports read equal in today's
   environment, none of its families loaded meanwhile — says again what the imports printed
   and warned (a warning the session makes an error raises, loading nothing, as the fresh
   import would), then puts the part back (and first
   the parts its modules refer to, as the boundary's rule has it), replays its filters and
   switches where the import runs now (inside a test's warning capture, say), and binds the
   variables it read, as the session's own import would have. Any difference: every part
   still waiting is dropped and the session imports afresh. A part nobody imports stays out
   of sight (``"x" in sys.modules`` is false, as in a fresh process).

Imports that do what cannot be put back (start a thread, change ``os.environ``,
``sys.path``, a signal handler, the ``sys`` hooks, the root logger, initialise CUDA) or
fail are not kept and the families are not imported ahead again in this rank; the log says
why. ``CPQ_IMPORT_AHEAD=0`` (the broker's environment) turns it off.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import io
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from cpq.rank import (
    boundary,
    carryover,
    freshness,
    importenv,
    items,
    reset,
    saved_state,
    warnfilters,
)

log = logging.getLogger("cpq.rank")

ENV = "CPQ_IMPORT_AHEAD"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass
class Plan:
    """What a session imported, and where: the imports to make ahead of the next one."""

    modules: list[str]
    path: list[str]
    cwd: str
    environ: dict[str, str]


@dataclass
class Part:
    """What one step of the warm-up imported, out of ``sys.modules`` until a session
    imports one of its top-level names."""

    order: int
    tops: set[str] = field(default_factory=set)
    reads: dict[str, str | None] = field(default_factory=dict)
    #: The warning filters its imports added: put in front (or moved there), appended.
    front: list[Any] = field(default_factory=list)
    back: list[Any] = field(default_factory=list)
    switches: dict[str, Any] = field(default_factory=dict)  # torch's, as its imports set them
    detached: boundary.Detached = field(default_factory=boundary.Detached)
    #: top-level name -> (its spec, the origin and search locations a fresh import must find)
    where: dict[str, tuple[Any, str | None, tuple[str, ...]]] = field(default_factory=dict)
    stamps: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    #: What its imports printed and warned, said again where a fresh import would say it.
    stdout: str = ""
    stderr: str = ""
    warned: list[Any] = field(default_factory=list)
    #: Variables its imports set, which the process keeps, set again where a fresh
    #: import would set them (:func:`keep_at_hand_over`).
    kept: Kept = field(default_factory=lambda: Kept())


@dataclass
class Kept:
    """What imports did that a process keeps and that whoever watches them (the warm
    caller's blame, :mod:`cpq.caller.blame`) replays: the variables they set, the entries
    they appended to ``sys.path``."""

    environ: dict[str, str] = field(default_factory=dict)
    path: list[str] = field(default_factory=list)

    def add(self, other: Kept) -> None:
        self.environ.update(other.environ)
        self.path += [entry for entry in other.path if entry not in self.path]

    def do(self) -> None:
        """Do it again here: a variable set, an entry appended where it is missing (as
        setuptools appends its ``_vendor``)."""
        os.environ.update(self.environ)
        sys.path += [entry for entry in self.path if entry not in sys.path]


_plan: Plan | None = None
#: top-level name -> the part holding it (a part holds one or more names).
_parts: dict[str, Part] = {}
#: top-level name -> why it is not imported ahead in this rank any more.
refused: dict[str, str] = {}
#: Why the last warm-up kept nothing ("" when it kept what it imported).
last_refusal = ""
#: What became of the last modules imported ahead, said at the next warm-up (a session's
#: pytest captures the rank's log while it imports).
_fate: dict[str, int | str] = {}
#: What the last warm-up's imports of modules that stayed loaded warned (torch's, a family
#: that registered torch operators): no part says it again; :func:`say_staying` does.
_staying_warned: list[Any] = []


def learn(crossed: boundary.Crossed, path: list[str], cwd: str, environ: dict[str, str]) -> None:
    """After a session (or launch) ended and the boundary ``crossed``: plan to import again
    what it forgot, in the session's ``path``, ``cwd`` and ``environ``."""
    global _plan
    _plan = None
    if not enabled():
        return
    tops = crossed.plain - items.test_tops - set(refused)
    modules = [name for name in crossed.forgotten if name.partition(".")[0] in tops]
    if modules:
        _plan = Plan(modules, list(path), cwd, dict(environ))


def plan(modules: list[str], path: list[str], cwd: str, environ: dict[str, str]) -> None:
    """Plan to import ``modules`` ahead (the warm caller, :mod:`cpq.caller.server`, plans
    what the project's last calling process imported)."""
    global _plan
    _plan = Plan(list(modules), list(path), cwd, dict(environ)) if modules else None


def pending() -> bool:
    return _plan is not None


def held() -> list[str]:
    """The top-level names imported ahead and not yet handed over (for the log, tests)."""
    return sorted(waiting())


def waiting() -> dict[str, Part]:
    """Each top-level name imported ahead and not yet handed over, with its part."""
    return dict(_parts)


def held_modules() -> list[Any]:
    """The modules imported ahead and not yet handed over (out of ``sys.modules``)."""
    parts = {id(part): part for part in _parts.values()}.values()  # a part holds several tops
    return [module for part in parts for module in part.detached.modules.values()]


def drop(why: str) -> None:
    """Forget every part still waiting (the next import of them is a fresh one)."""
    if _parts:
        _fate["dropped"] = why
    _parts.clear()
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


# ----------------------------------------------------------------------------- warming


def warm(
    task_waits: Callable[[], bool] = lambda: False,
    after_import: Callable[[str], bool] | None = None,
    kept: Kept | None = None,
) -> dict[str, str | None]:
    """Make the planned imports and keep them aside (see the module docstring). Run by the
    main thread while the rank waits for work; never raises. A task that arrives meanwhile
    (``task_waits()``) ends it after the family being imported: what is done is kept.

    Returns every variable the imports read, with the value read: families that cannot
    leave ``sys.modules`` (an extension's, torch's) stay loaded, and a process that goes on
    from here (the warm caller's fork) must check those in its own variables.
    What cannot be put back is checked after each family (the warm-up ends at the first
    that did such a thing) — or, given ``after_import(module)``, called after each
    module's import, by that function, which may end the warm-up there (by returning
    True); the end's check stands either way. The warm caller learns so which module did
    what a fork cannot take; what it found the imports doing that the process keeps
    (``kept``, filled meanwhile) is the fork's to replay, and the end's check allows it."""
    global _plan, last_refusal
    kept = Kept() if kept is None else kept
    plan, _plan = _plan, None
    last_refusal = ""
    _staying_warned.clear()
    drop("not imported by the session that just ended")  # the runtime did, unless a test
    if _fate:
        log.info("the modules imported ahead of the last session: %s", _said(_fate))
        _fate.clear()
    if plan is None:
        return {}
    started = time.perf_counter()
    saved = saved_state.Saved.take()
    loaded = set(sys.modules)
    parts: list[Part] = []
    why = ""
    try:
        reset.set_environ(plan.environ)
        os.chdir(plan.cwd)
        sys.path[:] = plan.path
        for family in _families(plan.modules):
            if task_waits():
                break
            _step(family, parts, after_import)
            why = "" if after_import is not None else saved.changed(plan.path, plan.environ, kept)
            if why:
                break
        why = why or saved.changed(plan.path, plan.environ, kept)
    except _Refused as refusal:
        why = str(refusal)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: the plan, never the rank
        why = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    detached = boundary.detach()  # what the imports loaded leaves sys.modules, whatever came
    saved.put_back()
    reads = {name: value for part in parts for name, value in part.reads.items()}
    tops = {name.partition(".")[0] for name in detached.modules}
    last_refusal = why
    if why or not tops:
        for top in tops | {name.partition(".")[0] for name in plan.modules}:
            refused[top] = why or "nothing to keep"
        # Every family the pass loaded goes, not only the one whose import did it (a blame,
        # where there is one, names that module: cpq.caller.blame).
        log.info(
            "not importing %s ahead of sessions: one of the pass's imports %s",
            ", ".join(sorted(tops)),
            why,
        )
        return reads
    stayed = {_file(sys.modules[n]) for n in set(sys.modules) - loaded} - {None}
    _staying_warned[:] = [said for part in parts for said in part.warned if said.filename in stayed]
    for part in parts:
        part.warned = [said for said in part.warned if said.filename not in stayed]
        part.tops = {top for top in part.tops & tops if top in detached.modules}
        part.detached = _share(detached, part.tops)
        part.where = {top: _where(part.detached.modules[top]) for top in part.tops}
        part.stamps = {path: freshness.file_stamp(path) for path in _files(part.detached)}
        _parts.update(dict.fromkeys(part.tops, part))
    sys.meta_path.insert(0, _FINDER)
    log.info(
        "imported ahead of the next session in %.2fs: %d modules of %s",
        time.perf_counter() - started,
        len(detached.modules),
        ", ".join(sorted(_parts))[:300],
    )
    return reads


def keep_at_hand_over(top: str, kept: Kept) -> bool:
    """Do ``kept`` when the part holding ``top`` is handed over (False: no part holds it)."""
    part = _parts.get(top)
    if part is None:
        return False
    part.kept.add(kept)
    return True


def forget_reads(names: Container[str]) -> None:
    """``names`` bind none of the held imports: variables the imports set themselves,
    checked and replayed by whoever hands them over (the warm caller's fork)."""
    for part in _parts.values():
        part.reads = {name: value for name, value in part.reads.items() if name not in names}


def _families(modules: list[str]) -> list[list[str]]:
    """``modules`` by family, each family where its first module was."""
    by_top: dict[str, list[str]] = {}
    for name in modules:
        by_top.setdefault(name.partition(".")[0], []).append(name)
    return list(by_top.values())


def _step(
    family: list[str], parts: list[Part], after_import: Callable[[str], bool] | None = None
) -> None:
    """Import one family's modules; what they load joins the part that holds the family, or
    a new one."""
    top = family[0].partition(".")[0]
    part = next((p for p in parts if top in p.tops), None)
    if part is None:
        part = Part(order=len(parts))
        parts.append(part)
    before, switches = set(sys.modules), carryover.read_switches()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        reads = stack.enter_context(importenv.diverted())
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        warnings.simplefilter("always")  # every warning, said again under the session's
        filters = list(warnings.filters)
        for name in family:
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
            except Exception as exc:  # this family only: what loaded before it is whole
                if isinstance(exc, ImportError) and "." in name:
                    continue  # a submodule loaded under a name of its own: skip it
                refused[top] = f"importing {name} failed: {type(exc).__name__}: {exc}"[:300]
                log.info(
                    "not importing %s ahead of sessions (the session imports it itself, "
                    "with the import path its conftests make): %s",
                    top,
                    refused[top],
                )
                break
            if after_import is not None and after_import(name):
                raise _Refused(f"stopped after importing {name}")
        delta = warnfilters.delta(filters, list(warnings.filters))
    part.tops |= {name.partition(".")[0] for name in set(sys.modules) - before} | {top}
    for name, value in reads.items():
        part.reads.setdefault(name, value)
    part.stdout += out.getvalue()
    part.stderr += err.getvalue()
    part.warned += caught or []
    if delta is None:
        raise _Refused("changed the warning filters other than by adding to them")
    part.front[:0] = delta[0]
    part.back += delta[1]
    part.switches.update(
        {n: v for n, v in carryover.read_switches().items() if switches.get(n) != v}
    )


class _Refused(Exception):
    """The imports did what cannot be replayed (the message says what)."""


def _share(detached: boundary.Detached, tops: set[str]) -> boundary.Detached:
    """The share of ``detached`` that belongs to the families ``tops``."""

    def mine(name: str) -> bool:
        return name.partition(".")[0] in tops

    return boundary.Detached(
        modules={n: m for n, m in detached.modules.items() if mine(n)},
        loggers={n: g for n, g in detached.loggers.items() if mine(n)},
        meta_path=[(i, h) for i, h in detached.meta_path if boundary.owner_top(h) in tops],
        path_hooks=[(i, h) for i, h in detached.path_hooks if boundary.owner_top(h) in tops],
    )


# ----------------------------------------------------------------------------- handing over


class _Finder:
    """First in ``sys.meta_path`` while parts wait: answers for their top-level names."""

    keep_across_boundary = True  # cpq's own hook: the boundary leaves it in place

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        part = _parts.get(name) if path is None else None
        if part is None:
            return None
        why = next(filter(None, (_why_not(p) for p in _needed(part))), "")
        if why:
            drop(why)
            if not why.endswith(_MEANWHILE):
                _fate["stale"] = why
            return None
        spec, origin, locations = part.where[name]
        found = importlib.machinery.ModuleSpec(name, _Loader(spec), origin=origin)
        if getattr(spec, "submodule_search_locations", None) is not None:
            found.submodule_search_locations = list(locations)  # what a probe reads
        return found

    def __repr__(self) -> str:
        return "<cpq: modules imported ahead of the session>"


class _Loader(importlib.abc.Loader):
    """Loads a module imported ahead: its part (and the parts it needs) go back."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def create_module(self, spec: Any) -> Any:
        part = _parts.get(spec.name)
        if part is None:  # dropped between find and load: a fresh import
            return None
        needed = _needed(part)
        try:  # first what their imports said: a warning this session makes an error raises
            for each in needed:
                _say(each)
        except BaseException:  # as the fresh import would, loading nothing
            drop("an import-time warning is an error in this session")
            raise
        for each in needed:
            _hand_over(each)
        return part.detached.modules[spec.name]

    def exec_module(self, module: Any) -> None:
        if self.spec is not None and getattr(module, "__spec__", None) is not self.spec:
            module.__spec__ = self.spec  # the import system set ours: the module's own back


def _needed(part: Part) -> list[Part]:
    """``part`` and the waiting parts its modules refer to, transitively, oldest first."""
    needed = {part.order: part}
    scan = [part]
    while scan:
        waiting = {top for top, p in _parts.items() if p.order not in needed}
        found = boundary.references((m for p in scan for m in p.detached.modules.values()), waiting)
        scan = [_parts[top] for top in found if _parts[top].order not in needed]
        needed.update((p.order, p) for p in scan)
    return [needed[order] for order in sorted(needed)]


#: The end of the one reason a part is not taken over that says nothing of its files.
_MEANWHILE = "was imported by other means meanwhile"


def stale() -> str:
    """Why what was imported ahead of this session was not what a fresh import would load
    now (a file changed, a variable or the path differs; "" when it was, or nothing was
    taken): a warm caller's fork then plans a new one (:mod:`cpq.client.handoff`)."""
    return str(_fate.get("stale", ""))


def _why_not(part: Part) -> str:
    """Why a fresh import would not load what ``part`` holds ("" when it would)."""
    for top in part.tops:
        if top in sys.modules:
            return f"{top} {_MEANWHILE}"
    variable = importenv.stale_read(part.reads)
    if variable:
        return f"the imports read {variable}, which differs in this session"
    for path, stamp in part.stamps.items():
        if freshness.file_stamp(path) != stamp:
            return f"{path} changed"
    for top, (_, origin, locations) in part.where.items():
        if _resolve(top) != (origin, locations):
            return f"{top} resolves elsewhere on this session's path"
    return ""


def say_staying() -> None:
    """Warn again what the last warm-up's imports of modules that stay loaded warned, under
    this session's filters: the warm caller's fork, at its session's start, where a fresh
    process's conftests would import them (``cpq.client.handoff``)."""
    _warn_again(_staying_warned, {n: m for n, m in sys.modules.items() if m is not None})


def say_at_start(warned: list[Any]) -> None:
    """:func:`say_staying` warns ``warned`` too (a prepared session's: cpq.caller.prepared)."""
    _staying_warned.extend(warned)


def refilter(part: Part) -> None:
    """Add ``part``'s warning filters again (handed over where they were undone after)."""
    if part.front or part.back:
        warnfilters.replay(part.front, part.back)


def _say(part: Part) -> None:
    """Print and warn what ``part``'s imports did, under this session's filters."""
    if part.stdout:
        sys.stdout.write(part.stdout)
    if part.stderr:
        sys.stderr.write(part.stderr)
    _warn_again(part.warned, part.detached.modules)


def _warn_again(warned: list[Any], modules: dict[str, Any]) -> None:
    by_file = {getattr(m, "__file__", None): (n, m) for n, m in modules.items()}
    for said in warned:
        name, module = by_file.get(said.filename, (None, None))
        registry = None if module is None else module.__dict__.setdefault("__warningregistry__", {})
        warnings.warn_explicit(
            said.message,
            said.category,
            said.filename,
            said.lineno,
            module=name,
            registry=registry,
            source=said.source,
        )


def _hand_over(part: Part) -> None:
    for top in part.tops:
        _parts.pop(top, None)
    if not _parts and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    boundary.attach(part.detached)
    refilter(part)
    carryover.put_switches(part.switches)
    part.kept.do()
    importenv.adopt(part.reads)
    _fate["taken over"] = int(_fate.get("taken over", 0)) + len(part.detached.modules)


def _resolve(top: str) -> tuple[str | None, tuple[str, ...]] | None:
    """Where a fresh import would find ``top``: the finders after this module's own, but
    those that ask the others in turn (the warm caller's record, a probe: they would ask
    this one again)."""
    for finder in list(sys.meta_path):
        if finder is _FINDER or getattr(finder, "delegates_to_meta_path", False):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(top, None)
        except Exception:
            return None
        if spec is not None:
            return spec.origin, tuple(spec.submodule_search_locations or ())
    return None


_FINDER = _Finder()


# ----------------------------------------------------------------------------- helpers


def _said(fate: dict[str, int | str]) -> str:
    said = []
    if "taken over" in fate:
        said.append(f"{fate['taken over']} modules were taken over")
    if "dropped" in fate:
        said.append(f"{'the rest' if said else 'they'} were dropped: {fate['dropped']}")
    return "; ".join(said)


def _where(module: Any) -> tuple[Any, str | None, tuple[str, ...]]:
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None)
    locations = tuple(getattr(spec, "submodule_search_locations", None) or ())
    return spec, origin, locations


def _file(module: Any) -> str | None:
    path = getattr(module, "__file__", None)
    return path if isinstance(path, str) else None


def _files(detached: boundary.Detached) -> list[str]:
    return [path for module in detached.modules.values() if (path := _file(module))]
