"""CPU stand-in for TE's ``run_attention_with_cp.py`` (selftest of the anchor's plumbing).

Same contract as TE's: ``run_dpa_with_cp(**kwargs)`` with string kwargs; with
``NVTE_CP_POOL_PG=1`` it reuses the caller's default process group and the module-level
``_pool_cp_comm_group`` when set, else it creates (and destroys) its own. Its "kernels":
the first case of a (model, qkv_format) configuration in a process sleeps
``FIRST_CONFIG_S`` (TE builds cuDNN plans then); every case all-reduces on the CP group.
Model ``cp_bad`` fails its check, as a real failing case would.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

_pool_cp_comm_group = None
_pool_cp_comm_sub_groups: list = []

FIRST_CONFIG_S = 0.4
_seen: set[tuple[str, str]] = set()


def run_dpa_with_cp(
    dtype="bf16",
    model=None,
    qkv_format="bshd",
    kernel_backend="FusedAttention",
    cp_comm_type="p2p",
    log_level="WARNING",
    **_ignored,
):
    pool_pg = os.getenv("NVTE_CP_POOL_PG", "0") == "1"
    if not pool_pg:
        dist.init_process_group(backend="gloo")
    reuse = pool_pg and _pool_cp_comm_group is not None
    group = _pool_cp_comm_group if reuse else dist.new_group(range(dist.get_world_size()))
    if (model, qkv_format) not in _seen:
        time.sleep(FIRST_CONFIG_S)
        _seen.add((model, qkv_format))
    torch.manual_seed(1234)
    x = torch.randn(64)
    y = x.clone()
    dist.all_reduce(y, group=group)
    expected = x * dist.get_world_size()
    assert torch.allclose(y, expected), "CP all-reduce differs from the reference"
    assert model != "cp_bad", f"{model}: out_cp vs out_no_cp mismatch (deliberate)"
    time.sleep(0.02)
    if not reuse:
        dist.destroy_process_group(group)
    if not pool_pg:
        dist.destroy_process_group()
