"""Real distributed checks that any warm group can run: each verifies its result on every rank.

These are the README's main job (``cpq submit --world-size 2 workers.collectives:all_reduce_check``)
and the tasks the core tests and benchmarks use.
"""

from __future__ import annotations

import gc
import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_check(numel: int = 1024) -> dict[str, Any]:
    """Sum of (rank + 1) over all ranks, checked element-wise on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.full((numel,), float(rank + 1), device=_device())
    dist.all_reduce(tensor)
    expected = world * (world + 1) / 2
    assert torch.all(tensor == expected), (
        f"rank {rank}: all_reduce gave {tensor[0].item()}, expected {expected}"
    )
    return {"rank": rank, "world_size": world, "sum": float(tensor[0].item())}


def all_gather_check(numel: int = 16) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(numel, dtype=torch.float32, device=_device()) + 1000 * rank
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    for peer, tensor in enumerate(gathered):
        expected = torch.arange(numel, dtype=torch.float32, device=_device()) + 1000 * peer
        assert torch.equal(tensor, expected), f"rank {rank}: chunk from rank {peer} is wrong"
    return {"rank": rank, "gathered": world}


def broadcast_check(src: int = 0, numel: int = 16) -> dict[str, Any]:
    rank = dist.get_rank()
    tensor = (
        torch.arange(numel, dtype=torch.float32, device=_device())
        if rank == src
        else torch.zeros(numel, device=_device())
    )
    dist.broadcast(tensor, src=src)
    assert torch.equal(tensor, torch.arange(numel, dtype=torch.float32, device=_device())), (
        f"rank {rank}: broadcast from {src} is wrong"
    )
    return {"rank": rank, "src": src}


def all_checks() -> dict[str, Any]:
    """The three checks in one task."""
    return {
        "all_reduce": all_reduce_check(),
        "all_gather": all_gather_check(),
        "broadcast": broadcast_check(),
    }


# ---- small tasks the tests and benchmarks use


def noop() -> None:
    """Nothing at all: measures cpq's own round trip."""


def rank_info() -> dict[str, Any]:
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "frozen_objects": gc.get_freeze_count(),
    }


def echo(**kwargs: Any) -> dict[str, Any]:
    return kwargs


def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def hold_until(path: str, timeout_s: float = 120.0) -> float:
    """Keeps the group busy until ``path`` exists; returns how long it waited.

    A test that needs a busy group (to look at status, queue behind it, drain around it)
    creates the file when it is done looking, instead of guessing a sleep long enough for a
    slow machine. ``timeout_s`` bounds the wait if the test dies before releasing it.
    """
    start = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g}s")
        time.sleep(0.01)
    return time.monotonic() - start


def fail_on_rank(rank: int = 1, message: str = "boom") -> None:
    assert dist.get_rank() != rank, f"{message} on rank {dist.get_rank()}"


def skip_everywhere(reason: str = "not supported here") -> None:
    import pytest

    pytest.skip(reason)


def getenv(names: list[str]) -> dict[str, str | None]:
    """The task's view of these environment variables."""
    return {name: os.environ.get(name) for name in names}


def pollute_state(seed_probe: bool = True) -> dict[str, Any]:
    """Changes what a warm rank must reset, and reports the state it found on entry."""
    found = {
        "env": os.environ.get("CPQ_TEST_POLLUTION"),
        "cwd": os.getcwd(),
        "random": random.random(),
        "torch": float(torch.rand(1).item()),
    }
    os.environ["CPQ_TEST_POLLUTION"] = "dirty"
    os.chdir("/")
    random.seed(999)
    torch.manual_seed(999)
    return found


def print_both(text: str = "hello") -> None:
    """Writes from Python and from C (os.write on fd 1/2), to show fd-level capture."""
    rank = dist.get_rank()
    print(f"{text} from python on rank {rank}")
    os.write(1, f"{text} from fd1 on rank {rank}\n".encode())
    os.write(2, f"{text} from fd2 on rank {rank}\n".encode())
