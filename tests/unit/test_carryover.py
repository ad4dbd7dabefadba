"""The session boundary's torch switches (cpq.rank.carryover): the list is measured against
the installed torch, and what a caller set is put back."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator

import pytest
import torch
import torch.backends

from cpq.rank import carryover


def _covered(name: str) -> bool:
    carryover._read(torch)  # builds SWITCHES
    names = [switch.name for switch in carryover.SWITCHES]
    return name in carryover.NOT_RESTORED or any(
        n == name or n.startswith(name + "[") or n == f"backends.{name}" for n in names
    )


def test_every_torch_setter_is_restored_or_said_why_not() -> None:
    setters = sorted(n for n in dir(torch) if n.startswith("set_") and callable(getattr(torch, n)))
    assert setters, "torch has no set_* functions?"
    missing = [n for n in setters if not _covered(n) and not _covered(n[len("set_") :])]
    assert not missing, f"torch switches neither restored nor listed in NOT_RESTORED: {missing}"


def test_every_backends_flag_is_restored_or_said_why_not() -> None:
    flags = []
    for info in pkgutil.iter_modules(torch.backends.__path__):
        try:
            module = importlib.import_module(f"torch.backends.{info.name}")
        except Exception:
            continue
        for name, value in vars(type(module)).items():
            if isinstance(value, torch.backends.ContextProp):
                flags.append(f"{info.name}.{name}")
    assert "cudnn.benchmark" in flags
    missing = [flag for flag in flags if not _covered(flag)]
    assert not missing, f"torch.backends flags neither restored nor listed: {missing}"


@pytest.fixture
def ready() -> Iterator[carryover.Carryover]:
    state = carryover.Carryover.capture()
    yield state
    state.restore_switches()  # whatever a failing test left


def test_what_a_caller_set_is_put_back(ready: carryover.Carryover) -> None:
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.set_grad_enabled(False)
    torch.set_printoptions(precision=2)
    restored = ready.restore_switches()
    assert set(restored) >= {
        "default_dtype",
        "deterministic_algorithms",
        "float32_matmul_precision",
        "backends.cudnn.benchmark",
        "grad_enabled",
        "printoptions",
    }
    assert torch.get_default_dtype() == torch.float32
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.is_grad_enabled()
    assert torch._tensor_str.PRINT_OPTS.precision == 4
    assert ready.restore_switches() == []  # nothing left to put back


def test_switches_put_back_while_idle_are_not_read_again_until_something_runs(
    ready: carryover.Carryover,
) -> None:
    """Between tasks with no session open, the rank puts the switches back at once (off the
    next task's path); the next boundary then has nothing to do, until the rank runs
    something again (a task, a post-mortem, imports ahead), which clears ``restored``."""
    torch.set_default_dtype(torch.float64)  # what the last task left
    ready.restore_while_idle()
    assert torch.get_default_dtype() == torch.float32
    assert ready.restored
    torch.set_default_dtype(torch.float64)  # as if the rank ran code without saying so
    assert ready.restore_switches() == []  # not read: the flag is the rank's promise
    ready.restored = False  # what the runtime does when a task, a post-mortem or imports run
    assert ready.restore_switches() == ["default_dtype"]
    assert torch.get_default_dtype() == torch.float32


def test_without_cuda_nothing_makes_a_rank_unfit(ready: carryover.Carryover) -> None:
    assert carryover.sticky_cuda_error() == ""
    assert ready.unfit_after_caller() == ""


def test_tf32_is_put_back(ready: carryover.Carryover) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = False
    ready.restore_switches()
    assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.allow_tf32


def test_a_mix_of_both_precision_apis_is_put_back(ready: carryover.Carryover) -> None:
    torch.set_float32_matmul_precision("medium")
    torch.backends.cuda.matmul.allow_tf32 = True  # the legacy API after the new one
    ready.restore_switches()
    assert torch.get_float32_matmul_precision() == "highest"  # raises on a mixed state
    assert not torch.backends.cuda.matmul.allow_tf32


def test_a_flag_whose_owner_appears_later_is_read_from_then_on() -> None:
    """The readers are bound once per torch module; a flag whose owner is not there yet (a
    submodule imported later, as the warm caller may read mid-import) is read once it is."""
    import types

    fake = types.SimpleNamespace(backends=types.SimpleNamespace())
    before = carryover._read(fake)
    assert "backends.cudnn.benchmark" not in before
    fake.backends.cudnn = types.SimpleNamespace(benchmark=True)
    assert carryover._read(fake)["backends.cudnn.benchmark"] is True
    fake.backends.cudnn.benchmark = False  # read afresh, not remembered
    assert carryover._read(fake)["backends.cudnn.benchmark"] is False
    assert carryover._read(torch) == carryover.read_switches()  # back to the real torch
