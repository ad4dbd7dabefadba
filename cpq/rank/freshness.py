"""Is the code this rank loaded still the code on disk? (docs/design.md, "Fidelity: code")

A warm rank keeps every module it ever imported. A fresh ``torchrun`` would import the
files as they are *now*; so before each task the rank checks that nothing it loaded has
changed since, and refuses the task when something has (the broker then runs it on a
fresh group). What is checked, and why that is enough:

* **Your code, file by file.** Every module in ``sys.modules`` whose file lies outside the
  interpreter's standard library and site-packages: the project's own modules, helpers
  imported directly or indirectly, package ``__init__`` files, the sources behind editable
  installs (``pip install -e``) and ``PYTHONPATH`` entries. Each file's ``(mtime_ns,
  size)`` is taken when the rank first sees the module and compared with ``os.stat``
  before every task: editors, ``git checkout`` and build tools all move the modification
  time. A file that changed while the task importing it ran cannot be told apart from
  the version loaded, so it counts as changed at once.
* **Installed packages, by directory.** Installing, upgrading or removing a distribution
  adds or removes entries in a site-packages directory (its ``*.dist-info`` is renamed by
  every version change), which moves that directory's modification time; one ``stat`` per
  site directory covers every installed package. Editing a file inside site-packages by
  hand is not seen (pip never does that; recycle with ``cpq stop``).
* **Not checked**: the standard library; in a rank, cpq's own package, also where it runs
  from a checkout (:class:`CodeWatch` says why; the warm caller watches it); files read as
  data (``open()``), which the task reads afresh anyway; and generated code in the caches of
  just-in-time compilers (Triton's ``TRITON_CACHE_DIR`` and ``~/.triton/cache``,
  TorchInductor's ``TORCHINDUCTOR_CACHE_DIR`` and ``<tmp>/torchinductor_<user>``,
  ``TORCH_EXTENSIONS_DIR`` and ``~/.cache/torch_extensions``), plus any directory in
  ``CPQ_UNWATCHED`` (``os.pathsep``-separated). A compiler writes such a module during the
  task that first imports it, and rewrites it when another process compiles the same kernel;
  its name is a hash of its source, so what the rank loaded is what a fresh run would load.
  Watching them stopped every group that compiled a kernel (seen with Transformer Engine on
  GPUs). Only these: ``~/.cache`` as a whole also holds the user's code (Hugging Face's
  ``trust_remote_code`` copies, torch hub checkouts).

The test file of a marker test is the exception: it is re-executed from its path whenever
it changes (:mod:`cpq.rank.pytest_task`), as pytest itself would load it, so its own edits
keep the group warm. Reloading any other module in place is not provably safe (other
modules hold references to its old functions and classes), so it is never done.

Cost: one ``stat`` per watched file and per site directory per task (~1 us each), and a
scan of ``sys.modules`` only when its size changed.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import site
import sys
import sysconfig
import tempfile
import time

log = logging.getLogger("cpq.rank")

#: Files modified this close to (or after) the start of the task that imported them may
#: have changed during the import; file times come from a coarse kernel clock.
MTIME_SLACK_NS = 50_000_000
_UNKNOWN = (-1, -1)

#: Test modules pytest imported in this rank (cpq.rank.items): an edit needs no fresh group.
reexecuted: set[str] = set()
#: cpq's own package, wherever it is installed from (a checkout on ``PYTHONPATH`` too).
_CPQ_DIR = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _library_dirs() -> tuple[list[str], list[str]]:
    """``(library prefixes not to watch file by file, site directories to watch whole)``."""
    paths = sysconfig.get_paths()
    sites = [paths["purelib"], paths["platlib"]]
    with contextlib.suppress(AttributeError):  # some embedded interpreters lack it
        sites += site.getsitepackages()
    user_site = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if isinstance(user_site, str):
        sites.append(user_site)
    sites = [os.path.realpath(s) for s in dict.fromkeys(sites) if os.path.isdir(s)]
    libs = [os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib")]
    prefixes = [p.rstrip(os.sep) + os.sep for p in dict.fromkeys(libs + sites)]
    return prefixes, sites


def cache_dirs() -> list[str]:
    """Directories of generated code (see the module docstring), as path prefixes."""
    env = os.environ
    home = os.path.expanduser("~")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (containers)
        user = str(os.getuid())
    # The defaults as well as the variables: TorchInductor sets TRITON_CACHE_DIR to its own
    # directory once imported, after Triton's driver has built its modules in ~/.triton
    # (seen on the H200 pair: tools/gpu/jit_check.py).
    user_cache = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    dirs = [
        env.get("TRITON_CACHE_DIR", ""),
        os.path.join(home, ".triton", "cache"),
        env.get("TORCHINDUCTOR_CACHE_DIR", ""),
        os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"),
        env.get("TORCH_EXTENSIONS_DIR", ""),
        os.path.join(user_cache, "torch_extensions"),
        *env.get("CPQ_UNWATCHED", "").split(os.pathsep),
    ]
    return [os.path.realpath(d).rstrip(os.sep) + os.sep for d in dirs if d]


def file_stamp(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


class CodeWatch:
    """The files this rank's code came from, and whether any of them changed.

    ``cpq=False``: cpq's own package is not watched. A rank's cpq is its broker's, which
    the caller compares with its own by code fingerprint; and a group restarted on an edit
    of cpq would run new rank code under the old broker. The warm caller watches it: what
    it forks is a caller's pytest process, cpq's client and plugin included, and an edit of
    them must reach the next session, as in a fresh process."""

    def __init__(self, cpq: bool = True) -> None:
        self._library, sites = _library_dirs()
        if not cpq:
            self._library.append(_CPQ_DIR + os.sep)
        self.files: dict[str, tuple[int, int]] = {}
        for directory in sites:
            stamp = file_stamp(directory)
            if stamp is not None:
                self.files[directory] = stamp
        self._seen: set[str] = set()
        self._modules_len = -1
        self._said = False

    def scan(self, since_ns: int) -> None:
        """Take note of modules imported since the last scan, which began at ``since_ns``
        (wall clock) or later."""
        if len(sys.modules) == self._modules_len:
            return
        self._modules_len = len(sys.modules)
        unwatched: tuple[str, ...] | None = None
        for name, module in list(sys.modules.items()):
            if name in self._seen or name in reexecuted:
                continue
            self._seen.add(name)
            path = getattr(module, "__file__", None)
            if not isinstance(path, str) or path in self.files:
                continue
            real = os.path.realpath(path)
            if real.startswith(tuple(self._library)):
                continue
            if unwatched is None:  # read now: a task's own variables may name the caches
                unwatched = tuple(cache_dirs())
                if not self._said:
                    self._said = True
                    log.info("not watching generated code under %s", ", ".join(unwatched))
            if real.startswith(unwatched):
                continue
            stamp = file_stamp(real)
            if stamp is None:  # a module without a file on disk (zip import, frozen)
                continue
            # Changed while being imported? Then what was loaded is unknown: stale.
            self.files[real] = _UNKNOWN if stamp[0] >= since_ns - MTIME_SLACK_NS else stamp

    def forget(self, modules: dict[str, str]) -> None:
        """Stop watching modules the session boundary forgot (:mod:`cpq.rank.boundary`):
        the next import executes the file as it is then, as a fresh process would, so an
        edit of it no longer needs a fresh group. A file another loaded module still comes
        from stays watched."""
        self._seen.difference_update(modules)
        self._modules_len = -1
        loaded = {getattr(m, "__file__", None) for m in list(sys.modules.values())}
        for path in modules.values():
            if path and path not in loaded:
                self.files.pop(os.path.realpath(path), None)

    def changed(self) -> str:
        """The first watched file that changed since it was loaded ("" when none did)."""
        for path, stamp in self.files.items():
            if file_stamp(path) != stamp:
                return path
        return ""


def now_ns() -> int:
    return time.time_ns()
