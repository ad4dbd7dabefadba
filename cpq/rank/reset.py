"""State reset between tasks in a warm rank (rank side).

A warm group runs many unrelated tests in one process, so whatever one test leaves behind
must not reach the next: environment variables, the working directory, replaced
``sys.stdout``, random number generators, Transformer Engine's FP8 and attention-backend
caches, the CUDA caching allocator. Users add their own steps with
:func:`register_reset_hook` (from code the task imports) or by naming ``module:function``
hooks in ``CPQ_RESET_HOOKS`` (comma separated) in the group's environment.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from cpq import environ, rng

ResetHook = Callable[[int], None]
_hooks: list[ResetHook] = []


def register_reset_hook(hook: ResetHook) -> ResetHook:
    """Call ``hook(seed)`` before every task in this rank. Usable as a decorator."""
    if hook not in _hooks:
        _hooks.append(hook)
    return hook


@dataclass
class Baseline:
    """What a rank looked like right after start-up; every task starts from here."""

    start_environ: dict[str, str]  # os.environ once ready (after preloads)
    cwd: str
    stdout: TextIO
    stderr: TextIO
    #: The caller environment applied last (None: the baseline's own) and what
    #: ``os.environ`` held right after, to see whether a task changed it.
    applied: dict[str, str] | None = None
    _applied_data: Any = None

    @classmethod
    def capture(cls) -> Baseline:
        baseline = cls(dict(os.environ), os.getcwd(), sys.stdout, sys.stderr)
        baseline.remember(None)
        return baseline

    def remember(self, caller_env: dict[str, str] | None) -> None:
        self.applied = None if caller_env is None else dict(caller_env)
        data = getattr(os.environ, "_data", None)
        self._applied_data = dict(data) if data is not None else dict(os.environ)

    def environ_changed(self) -> bool:
        """Whether ``os.environ`` differs from what was applied last. os.environ's own
        ``__eq__`` decodes every entry (~150 us); its private byte dict compares in C."""
        data = getattr(os.environ, "_data", None)
        return bool((data if data is not None else dict(os.environ)) != self._applied_data)


DEFAULT_KEEP_ENV = ("NVTE_CUDA_INCLUDE_DIR",)


def _kept_env_names() -> tuple[str, ...]:
    extra = os.environ.get("CPQ_KEEP_ENV", "")
    return DEFAULT_KEEP_ENV + tuple(n.strip() for n in extra.split(",") if n.strip())


def _apply_environ(baseline: Baseline, caller_env: dict[str, str] | None) -> None:
    """``os.environ`` for the next task: the caller's (see :func:`cpq.environ.task_environ`).

    Cheap when nothing changed: the same caller environment as last time, applied to an
    ``os.environ`` that the previous task left alone, is a dict comparison.
    """
    if baseline.applied == caller_env and not baseline.environ_changed():
        return
    set_environ(environ_for(baseline, caller_env))
    baseline.remember(caller_env)


def environ_for(baseline: Baseline, caller_env: dict[str, str] | None) -> dict[str, str]:
    """The ``os.environ`` a task of ``caller_env`` runs in."""
    # Variables a library sets on itself while being imported by a task must survive,
    # or the library breaks in the next task; CPQ_KEEP_ENV names them (TE's by default).
    kept = {k: os.environ[k] for k in _kept_env_names() if k in os.environ}
    baseline.start_environ.update(kept)
    if caller_env is None:
        return dict(baseline.start_environ)
    return environ.task_environ(caller_env, baseline.start_environ, kept)


def set_environ(target: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``target`` by its difference only: the caller's variables
    change little from test to test (``PYTEST_CURRENT_TEST``), and each ``os.environ``
    write is a ``putenv`` — rewriting ~100 variables cost ~1 ms a task."""
    current = os.environ
    for name in [name for name in current if name not in target]:
        del current[name]
    for name, value in target.items():
        if current.get(name) != value:
            current[name] = value


def load_hooks_from_env() -> None:
    for spec in filter(None, os.environ.get("CPQ_RESET_HOOKS", "").split(",")):
        module, _, name = spec.strip().partition(":")
        register_reset_hook(getattr(importlib.import_module(module), name))


def reset_state(
    baseline: Baseline,
    seed: int,
    caller_env: dict[str, str] | None = None,
    rng_state: dict[str, Any] | None = None,
    generators: bool = True,
) -> None:
    """Bring the rank back to its baseline, in the caller's environment (``caller_env``:
    the task variables its client sent; None: the baseline's own, for older clients).
    ``rng_state``: the caller's ``random``/``numpy`` state (:mod:`cpq.rng`), installed
    after the fixed seed; torch keeps the fixed seed.

    ``generators=False`` for a test the ranks run through pytest: its session keeps the
    generators, CUDA's cache and Transformer Engine's state going from test to test, as one
    fresh pytest process does (:mod:`cpq.rank.items`; a session's start is a boundary of
    its own, :func:`cpq.rank.items.run_item`). That is also what keeps such a task's own cost
    near zero: the CUDA synchronise and cache release below cost milliseconds a task on a
    GPU and make the next test allocate its memory again."""
    _apply_environ(baseline, caller_env)
    if os.getcwd() != baseline.cwd:
        os.chdir(baseline.cwd)
    sys.stdout, sys.stderr = baseline.stdout, baseline.stderr
    if generators:
        _reset_generators_and_caches(seed)
    else:
        _reset_peaks()  # each task's peak is its own (the rank reports it)
    for hook in _hooks:
        hook(seed)
    if rng_state is not None:  # last: a hook that seeds random must not undo the caller's
        rng.install(rng_state)


def release_cuda_cache() -> None:
    """Wait for the device and hand the allocator's cached blocks back, peaks reset."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _reset_peaks() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _reset_generators_and_caches(seed: int) -> None:
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        # Not torch.manual_seed: it records a Python stack for lazy CUDA/XPU seeding on every
        # call (~1 ms), which would dominate a warm no-op task. CUDA is seeded directly once
        # it is initialised (nccl groups initialise it at start-up).
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
    release_cuda_cache()
    reset_transformer_engine()


def reset_transformer_engine() -> None:
    """Reset TE's process-wide state, if TE was imported by an earlier task.

    TE keeps FP8 recipe/amax state in ``FP8GlobalStateManager`` and caches which attention
    backend it picked; a test that changed either would otherwise steer the next one.
    """
    if "transformer_engine.pytorch" not in sys.modules:
        return
    fp8: Any = _find_attr(
        ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization"),
        "FP8GlobalStateManager",
    )
    if fp8 is not None and hasattr(fp8, "reset"):
        fp8.reset()
    for module_name in (
        "transformer_engine.pytorch.attention.dot_product_attention.utils",
        "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention",
        "transformer_engine.pytorch.attention",
    ):
        module = sys.modules.get(module_name)
        backends = getattr(module, "_attention_backends", None)
        if isinstance(backends, dict):
            backends["backend_selection_requires_update"] = True


def _find_attr(modules: tuple[str, ...], name: str) -> object | None:
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, name):
            found: object = getattr(module, name)
            return found
    return None
