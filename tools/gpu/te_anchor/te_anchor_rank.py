"""Rank side of the TE anchor: what a warm cpq rank runs for one case of TE's CP test file.

Transformer Engine's own pool (``run_attention_with_cp_pool.py``) does, per rank and once
per pool: ``init_process_group`` (cpq's rank has done that), ``NVTE_CP_POOL_PG=1`` (here
a task variable the adapter sends), and it creates the CP process groups once and stashes
them on the ``run_attention_with_cp`` module so every case reuses them. Per case it
reseeds (1234), resets FP8 state and empties the CUDA cache (cpq's reset does the same
before every task) and calls ``run_dpa_with_cp(**kwargs)``. :func:`run_case` does exactly
that inside a cpq rank: TE's own ``run_dpa_with_cp``, unchanged, from ``$TE_PATH``.

Nothing heavy is imported at module level, so the module imports on any machine.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

#: Where TE's test files live under ``$TE_PATH`` (as TE's own pool looks for them).
ATTENTION_DIR = os.path.join("tests", "pytorch", "attention")


def _te_modules() -> Any:
    """``run_attention_with_cp`` from ``$TE_PATH`` (its directory on sys.path, as TE's pool
    script puts its own directory there; the test file appends ``tests/pytorch`` itself)."""
    te_path = os.environ.get("TE_PATH", "/opt/transformerengine")
    directory = os.path.join(te_path, ATTENTION_DIR)
    if directory not in sys.path:
        sys.path.append(directory)
    import run_attention_with_cp  # under $TE_PATH: imported on demand

    return run_attention_with_cp


def _pool_groups(rac: Any) -> None:
    """Create the CP groups once per rank process, as TE's pool does per pool: the world
    group, and for an even world size >= 4 the a2a+p2p sub-groups."""
    if rac._pool_cp_comm_group is not None:
        return
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()  # nccl on GPUs; gloo in the CPU selftest
    rac._pool_cp_comm_group = dist.new_group(range(world_size), backend=backend)
    subs: list[Any] = []
    if world_size >= 4 and world_size % 2 == 0:
        ranks = [range(i * 2, (i + 1) * 2) for i in range(world_size // 2)]
        ranks += [range(i, world_size, 2) for i in range(2)]
        for sub_ranks in ranks:
            group = dist.new_group(sub_ranks, backend=backend)
            if rank in sub_ranks:
                subs.append(group)
    rac._pool_cp_comm_sub_groups = subs


def run_case(kwargs: dict[str, str]) -> dict[str, Any]:
    """One case of TE's CP test file: ``run_dpa_with_cp(**kwargs)`` with the pool's groups.

    ``kwargs`` are what the test's ``_submit`` sends TE's pool (every value a string).
    Returns this rank's pid and the case's wall time (rank 0's reaches the client).
    """
    started = time.perf_counter()
    rac = _te_modules()
    if os.environ.get("NVTE_CP_POOL_PG") == "1":
        _pool_groups(rac)
    rac.run_dpa_with_cp(**kwargs)
    return {"pid": os.getpid(), "case_s": round(time.perf_counter() - started, 4)}
