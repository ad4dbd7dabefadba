"""What one caller leaves in a warm rank that the next must not find (rank side).

A fresh ``torchrun -m pytest`` session and a fresh ``torchrun script`` launch each start a new
process. A warm rank serves one calling session after another, so at each boundary (a new
session's first test, a launch, a function task) it puts back what a new process would
have, or, where it cannot, stops serving (docs/design.md, "The session boundary"):

* **torch's process-wide switches** (:data:`SWITCHES`): restored to what the rank had when
  it became ready. The list is measured, not guessed: ``tests/unit/test_carryover.py`` walks
  every ``torch.set_*`` and the ``torch.backends`` flags of the installed torch and fails on
  one that is neither restored here nor in :data:`NOT_RESTORED` with the reason.
* **GPU memory still held** after the session's objects are gone (its test modules
  forgotten, a garbage collection, the allocator's cache released): beyond the ready
  baseline plus :data:`MEMORY_ALLOWANCE_MB`, the rank is unfit to serve another caller.
* **A sticky CUDA error** (a device-side assert poisons the CUDA context for the process's
  life): the rank is unfit at once, after the failing test's own report.

Inside one calling session nothing here runs: a fresh pytest process carries all of this
from test to test too.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("cpq.rank")

#: GPU memory (MB) a caller may leave above the ready baseline (the allocator's rounding,
#: a library's small lazily made workspace) before the rank serves no other caller.
MEMORY_ALLOWANCE_MB = 512.0

#: ``torch.set_*`` functions and flags deliberately not restored, and why.
NOT_RESTORED = {
    "set_flush_denormal": "torch has no getter: what a test set cannot be read back",
    "set_num_interop_threads": "can be set once per process, before any inter-op work",
    "set_rng_state": "the generators start fresh per session (cpq.rank.items)",
    "set_default_tensor_type": "deprecated; restored through the default dtype and device",
    "set_autocast_ipu_dtype": "no IPU",
    "set_autocast_ipu_enabled": "no IPU",
    "set_autocast_xla_dtype": "no XLA",
    "set_autocast_xla_enabled": "no XLA",
    "set_autocast_gpu_dtype": "the CUDA autocast dtype (set_autocast_dtype('cuda'))",
    "set_autocast_cpu_dtype": "the CPU autocast dtype (set_autocast_dtype('cpu'))",
    "set_autocast_cpu_enabled": "the CPU autocast switch (set_autocast_enabled('cpu'))",
}


@dataclass(frozen=True)
class Switch:
    """One process-wide setting: how to read it, how to set it back."""

    name: str
    get: Callable[[Any], Any]
    put: Callable[[Any, Any], None]
    #: For a flag read as an attribute: the object that holds it, from torch, and its name.
    owner: Callable[[Any], Any] | None = None
    attr: str = ""

    def reader(self, torch: Any) -> Callable[[], Any]:
        """A function of no argument that reads the switch of ``torch``; an attribute's
        owner (``torch.backends.cudnn``, a module object torch never replaces) is looked
        up here, once, not at every read: a function task reads every switch (43 on torch
        2.13) before it runs, 31 µs with the walks and 18 µs without (BENCHMARKS.md)."""
        if self.owner is None:
            return functools.partial(self.get, torch)
        return functools.partial(getattr, self.owner(torch), self.attr)


def _attr(path: str) -> Switch:
    """A flag read and written as an attribute (``backends.cudnn.benchmark``)."""
    owner_path, _, attr = path.rpartition(".")

    def owner(torch: Any) -> Any:
        obj = torch
        for part in owner_path.split("."):
            obj = getattr(obj, part)
        return obj

    return Switch(
        path,
        lambda torch: getattr(owner(torch), attr),
        lambda torch, value: setattr(owner(torch), attr, value),
        owner,
        attr,
    )


def _deterministic_get(torch: Any) -> Any:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _deterministic_put(torch: Any, value: Any) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _anomaly_get(torch: Any) -> Any:
    return (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())


def _anomaly_put(torch: Any, value: Any) -> None:
    torch.set_anomaly_enabled(value[0], value[1])


def _print_get(torch: Any) -> Any:
    return dict(vars(torch._tensor_str.PRINT_OPTS))


def _print_put(torch: Any, value: Any) -> None:
    vars(torch._tensor_str.PRINT_OPTS).update(value)


def _autocast(device: str) -> list[Switch]:
    return [
        Switch(
            f"autocast_enabled[{device}]",
            lambda torch: torch.is_autocast_enabled(device),
            lambda torch, v: torch.set_autocast_enabled(device, v),
        ),
        Switch(
            f"autocast_dtype[{device}]",
            lambda torch: torch.get_autocast_dtype(device),
            lambda torch, v: torch.set_autocast_dtype(device, v),
        ),
    ]


def _sdp(kind: str) -> Switch:
    """One of scaled-dot-product attention's kernel switches (``enable_flash_sdp``)."""

    def get(torch: Any) -> Any:
        return getattr(torch.backends.cuda, f"{kind}_sdp_enabled")()

    def put(torch: Any, value: Any) -> None:
        getattr(torch.backends.cuda, f"enable_{kind}_sdp")(value)

    return Switch(f"sdp.{kind}", get, put)


def _switches() -> list[Switch]:
    plain = [
        Switch(
            "default_dtype", lambda t: t.get_default_dtype(), lambda t, v: t.set_default_dtype(v)
        ),
        Switch("deterministic_algorithms", _deterministic_get, _deterministic_put),
        Switch(
            "deterministic_debug_mode",
            lambda t: t.get_deterministic_debug_mode(),
            lambda t, v: t.set_deterministic_debug_mode(v),
        ),
        Switch(
            "float32_matmul_precision",
            lambda t: t.get_float32_matmul_precision(),
            lambda t, v: t.set_float32_matmul_precision(v),
        ),
        Switch("grad_enabled", lambda t: t.is_grad_enabled(), lambda t, v: t.set_grad_enabled(v)),
        Switch("anomaly_enabled", _anomaly_get, _anomaly_put),
        Switch("num_threads", lambda t: t.get_num_threads(), lambda t, v: t.set_num_threads(v)),
        Switch(
            "warn_always", lambda t: t.is_warn_always_enabled(), lambda t, v: t.set_warn_always(v)
        ),
        Switch(
            "default_device", lambda t: t.get_default_device(), lambda t, v: t.set_default_device(v)
        ),
        Switch(
            "autocast_cache_enabled",
            lambda t: t.is_autocast_cache_enabled(),
            lambda t, v: t.set_autocast_cache_enabled(v),
        ),
        Switch("printoptions", _print_get, _print_put),
    ]
    flags = [
        _attr(f"backends.{path}")
        for path in (
            "cuda.matmul.allow_tf32",
            "cuda.matmul.allow_fp16_reduced_precision_reduction",
            "cuda.matmul.allow_bf16_reduced_precision_reduction",
            "cudnn.allow_tf32",
            "cudnn.benchmark",
            "cudnn.benchmark_limit",
            "cudnn.deterministic",
            "cudnn.enabled",
            "cudnn.depthwise_kernel",
            "mkldnn.enabled",
            "mkldnn.deterministic",
            "mkldnn.allow_tf32",
            "miopen.immediate",
            "opt_einsum.enabled",
            "opt_einsum.strategy",
        )
    ]
    sdp = [_sdp(kind) for kind in ("flash", "mem_efficient", "math", "cudnn")]
    # torch 2.9's per-backend precision (``fp32_precision``): the same state as the legacy
    # TF32 flags and the matmul precision seen another way. Restored last, so that a mix of
    # both APIs left by a test (which makes ``get_float32_matmul_precision`` raise) ends
    # as the ready rank's values.
    precision = [
        _attr(f"backends.{path}")
        for path in (
            "fp32_precision",
            "cuda.matmul.fp32_precision",
            "cudnn.fp32_precision",
            "cudnn.conv.fp32_precision",
            "cudnn.rnn.fp32_precision",
            "mkldnn.fp32_precision",
            "mkldnn.matmul.fp32_precision",
            "mkldnn.conv.fp32_precision",
            "mkldnn.rnn.fp32_precision",
        )
    ]
    return plain + flags + sdp + _autocast("cpu") + _autocast("cuda") + precision


#: Every switch this torch has, restored at a boundary (built on first use).
SWITCHES: list[Switch] = []

#: ``(name, read)`` for the switches of :data:`SWITCHES`, bound to the torch module named
#: by ``_readers_of`` (see :meth:`Switch.reader`); a switch whose owner that torch lacks
#: (an older torch; a submodule not imported yet) is tried again at each read.
_readers: dict[str, Callable[[], Any]] = {}
_readers_of: list[Any] = []


def _read(torch: Any) -> dict[str, Any]:
    if not SWITCHES:
        SWITCHES.extend(_switches())
    if not _readers_of or _readers_of[0] is not torch:
        _readers.clear()
        _readers_of[:] = [torch]
    values: dict[str, Any] = {}
    for switch in SWITCHES:
        try:
            read = _readers.get(switch.name)
            if read is None:
                read = _readers[switch.name] = switch.reader(torch)
            values[switch.name] = read()
        except Exception:  # an older torch without it: nothing to restore
            continue
    return values


def read_switches() -> dict[str, Any]:
    """torch's switches now (empty without torch)."""
    torch = sys.modules.get("torch")
    return {} if torch is None else _read(torch)


def put_switches(values: dict[str, Any]) -> None:
    """Set the switches named in ``values`` (read by :func:`read_switches`)."""
    torch = sys.modules.get("torch")
    by_name = {switch.name: switch for switch in SWITCHES}
    for name, value in values.items():
        if torch is not None and name in by_name:
            try:
                by_name[name].put(torch, value)
            except Exception:
                log.exception("setting torch's %s failed", name)


@dataclass
class Carryover:
    """The rank as it was when ready: its switches and the GPU memory it held."""

    switches: dict[str, Any] = field(default_factory=dict)
    cuda_reserved_mb: float = 0.0
    #: The switches were put back after the last task and nothing ran since: the next
    #: boundary has nothing to restore (:meth:`restore_while_idle`).
    restored: bool = False
    #: Python threads when the rank was ready (its own).
    threads: int = 0

    @classmethod
    def capture(cls) -> Carryover:
        torch = sys.modules.get("torch")
        if torch is None:
            return cls(threads=threading.active_count())
        return cls(_read(torch), _reserved_mb(torch), threads=threading.active_count())

    def restore_while_idle(self) -> None:
        """Put the switches back now, between tasks, when the next task crosses a boundary
        whatever it is (no calling session is open here): reading 43 switches is then off
        the next task's path. Whatever runs on this rank before that task (a post-mortem,
        imports ahead) must say so (``restored = False``). A thread a caller left running
        could set a switch after this: then nothing is promised."""
        self.restore_switches()
        self.restored = threading.active_count() <= self.threads

    def restore_switches(self) -> list[str]:
        """Set every switch that differs from the ready rank's back; the names set."""
        if self.restored:  # nothing ran since they were put back
            return []
        torch = sys.modules.get("torch")
        if torch is None or not self.switches:
            return []
        changed = [
            n for n, v in _read(torch).items() if n in self.switches and v != self.switches[n]
        ]
        by_name = {switch.name: switch for switch in SWITCHES}
        for name in changed:
            try:
                by_name[name].put(torch, self.switches[name])
            except Exception:
                log.exception("restoring torch's %s failed", name)
        if changed:
            log.info("restored torch's %s, left by the previous caller", ", ".join(changed))
        return changed

    def unfit_after_caller(self) -> str:
        """Why this rank must serve no other caller ("" when it may): a sticky CUDA error,
        or GPU memory held beyond the ready baseline once the caller's objects are gone."""
        broken = sticky_cuda_error()
        if broken:
            return broken
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return ""
        # A full collection, cheap: the rank froze what it held when it became ready
        # (runtime.main: gc.freeze), so this walks only what callers made since.
        gc.collect()
        torch.cuda.empty_cache()
        held = _reserved_mb(torch) - self.cuda_reserved_mb
        if held > MEMORY_ALLOWANCE_MB:
            return (
                f"still holds {held / 1024:.1f} GiB of GPU memory after its caller's objects "
                f"are gone (a module global?); a new process would hold none"
            )
        return ""


def sticky_cuda_error() -> str:
    """The CUDA error this process is stuck with ("" when none or without CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return ""
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # a device-side assert and the like: every call fails now
        first = str(exc).strip().partition("\n")[0]
        return f"has a sticky CUDA error ({first[:200]}); a new process would not"
    return ""


def _reserved_mb(torch: Any) -> float:
    if not torch.cuda.is_initialized():
        return 0.0
    return float(torch.cuda.memory_reserved()) / 2**20
