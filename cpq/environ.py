"""Whose environment a task runs with: the caller's (docs/design.md, "Fidelity").

A warm group was started once, by whichever broker, from whichever shell; the test it runs
now was started from *this* shell. For the verdict to be the one a fresh ``torchrun`` from
this shell would give, the ranks must see this shell's environment. Variables fall into
four kinds, and this module is the one place that says which is which:

* **start variables** are read once, when a process (or a library it loads) starts:
  ``CUDA_*``, ``NCCL_*``, ``TORCH_*``, ``OMP_*``, ``LD_*``, ``PYTHON*``, plus any name the
  caller lists in ``CPQ_SPEC_ENV``. Changing one after start-up has no effect, so they are
  part of the pool spec: a caller with other values gets a group of its own.
* **launcher variables** are torchrun's (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``TORCHELASTIC_*`` ...) and describe the group itself; a caller's values never reach a
  rank (the caller is usually not inside any torchrun at all).
* ``CUDA_VISIBLE_DEVICES`` is the broker's to assign. A caller's value travels in the spec
  but only *narrows* which physical GPUs the caller's groups may get.
* everything else is a **task variable**: sent with every task, applied on every rank
  before the task runs, and taken away after it.

Imports nothing else of cpq: the client, the broker's supervisor and the rank runtime all
classify with the same rules.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

#: Prefixes of variables read at process start (part of the pool spec).
START_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "OMP_", "LD_", "PYTHON")
#: The caller's own extra start variables, comma separated (itself a start variable).
SPEC_ENV_VAR = "CPQ_SPEC_ENV"
#: Set by torchrun for each rank; they describe the group, not the caller.
LAUNCHER_VARS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)
GPU_VAR = "CUDA_VISIBLE_DEVICES"
#: The minimum a group process inherits from the broker that starts it: enough for an
#: interpreter and its libraries to start (find programs, a home, a temp dir, a locale).
#: Nothing else of the broker's environment reaches a group; tasks get the caller's.
PROCESS_BASE_VARS = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TMPDIR",
    "TZ",
    "XDG_RUNTIME_DIR",
)


def is_launcher_var(name: str) -> bool:
    return name in LAUNCHER_VARS or name.startswith(LAUNCHER_PREFIXES)


def extra_start_names(environ: Mapping[str, str]) -> frozenset[str]:
    listed = environ.get(SPEC_ENV_VAR, "")
    return frozenset(n.strip() for n in listed.split(",") if n.strip())


def is_start_var(name: str, extra: frozenset[str] = frozenset()) -> bool:
    """Read at process start (part of the spec); never a launcher variable."""
    if is_launcher_var(name):
        return False
    return name.startswith(START_PREFIXES) or name in extra or name == SPEC_ENV_VAR


def split(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """A caller's environment as ``(start variables, task variables)``.

    Launcher variables go to neither. ``CUDA_VISIBLE_DEVICES`` counts as a start variable
    (the broker reads it as a GPU filter, see :func:`gpu_filter`).
    """
    extra = extra_start_names(environ)
    start: dict[str, str] = {}
    task: dict[str, str] = {}
    for name, value in environ.items():
        kind = _kind(name, extra)
        if kind == _START:
            if name.endswith("PATH"):
                folded = path_list(value)
                if folded is None:
                    continue
                value = folded
            start[name] = value
        elif kind == _TASK:
            task[name] = value
    return start, task


_LAUNCHER, _START, _TASK = range(3)

#: The folder ``pytest --cpq-torchrun`` puts in front of ``PYTHONPATH`` (and ``PATH``) is
#: named ``<state>/torchrun-route-<digest>``: it holds only cpq's start-up hook and
#: ``torchrun`` shim, which change nothing in a rank, so it is no part of a spec.
ROUTE_FOLDER_PREFIX = "torchrun-route-"


def is_route_folder(entry: str) -> bool:
    return os.path.basename(entry.rstrip(os.sep)).startswith(ROUTE_FOLDER_PREFIX)


@functools.lru_cache(maxsize=256)
def fold_paths(value: str) -> str:
    """A path list (``PYTHONPATH``, ``LD_LIBRARY_PATH``) as a spec keeps it: each entry once
    (the first wins, as in a search), without cpq's routing folder. A shell, a serial pytest
    session and xdist workers (which put the routing folder in twice) then share groups:
    a second copy of an entry finds nothing the first did not."""
    entries = [e for e in value.split(os.pathsep) if not is_route_folder(e)]
    return os.pathsep.join(dict.fromkeys(entries))


def pythonpath_entries(value: str, cwd: str) -> list[str]:
    """The folders a ``PYTHONPATH`` of ``value`` adds for a process in ``cwd``, as Python
    reads it: relative to ``cwd``, an empty entry (``:/x``) ``cwd`` itself, an empty
    variable nothing."""
    if not value:
        return []
    return [os.path.normpath(os.path.join(cwd, e)) if e else cwd for e in value.split(os.pathsep)]


def path_list(value: str | None) -> str | None:
    """A path list as a spec keeps it (:func:`fold_paths`); None for none, and for one that
    held nothing but cpq's routing folder: ``pytest --cpq-torchrun`` sets ``PYTHONPATH`` to
    that folder where the shell had none, and a shell's launch must share its groups."""
    if value is None:
        return None
    folded = fold_paths(value)
    return None if value and not folded else folded


@functools.lru_cache(maxsize=4096)
def _kind(name: str, extra: frozenset[str]) -> int:
    """A variable's kind, cached: :func:`split` runs on every submit, over every variable."""
    if is_launcher_var(name):
        return _LAUNCHER
    return _START if is_start_var(name, extra) else _TASK


def gpu_filter(spec_env: Mapping[str, str]) -> list[str] | None:
    """The physical GPU ids a caller's ``CUDA_VISIBLE_DEVICES`` allows (None: any).

    An empty value or ``-1`` allows none, as it hides every GPU from a fresh process.
    """
    value = spec_env.get(GPU_VAR)
    if value is None:
        return None
    ids = [g.strip() for g in value.split(",") if g.strip()]
    return [] if not ids or ids[0] == "-1" else ids


#: Variables that keep NVLink multicast off. Forced in every group's start environment and
#: again in every task's (:func:`task_environ`), whatever the caller's shell or ``env=``
#: says: a program that uses multicast can take a shared host's GPUs out of service.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def task_environ(
    caller: Mapping[str, str],
    group: Mapping[str, str],
    kept: Mapping[str, str],
) -> dict[str, str]:
    """What ``os.environ`` is on a rank while a task runs.

    ``caller`` is the task's environment as the client sent it (task variables only),
    ``group`` the rank's own environment at start-up, ``kept`` what must survive from the
    rank's baseline regardless (variables its preloaded libraries set on themselves, and
    ``CPQ_KEEP_ENV``). The caller's task variables are applied; the group keeps its start
    variables (equal to the caller's by the spec, plus what torchrun adds the same way for a
    fresh launch), its launcher variables, its GPUs and cpq's own ``CPQ_*`` wiring.
    """
    extra = extra_start_names(group)
    env = {
        name: value
        for name, value in group.items()
        if is_launcher_var(name)
        or is_start_var(name, extra)
        or name.startswith("CPQ_")
        or name == GPU_VAR
    }
    for name, value in caller.items():
        if name not in env and not is_launcher_var(name) and not is_start_var(name, extra):
            env[name] = value
    env.update(kept)
    env.update(MULTICAST_OFF_ENV)  # not a start variable of every library: forced per task
    return env


def process_base(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The few variables of the broker's own environment a new group process starts with."""
    source = os.environ if environ is None else environ
    return {name: source[name] for name in PROCESS_BASE_VARS if name in source}
