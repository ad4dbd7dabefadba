"""Which GPUs a broker has (``--gpus auto|none|0,1,...|fake:N``), by the id its ranks see
and by the UUID its leases are named by.

``CUDA_VISIBLE_DEVICES`` ids are what a group's ranks get; they differ between containers
(each numbers its GPUs from 0), so node-wide leases (:mod:`cpq.broker.leases`) are named by
UUID, which ``nvidia-smi`` reports. ``--gpus fake:N`` is a test inventory: ids ``0..N-1``,
UUIDs ``GPU-fake-<i>``; its ranks get ``CUDA_VISIBLE_DEVICES`` as with real GPUs but run gloo
and touch no CUDA, so placement and leases are tested on a CPU machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

_FAKE = re.compile(r"fake:([0-9]+)")


@dataclass
class Inventory:
    gpus: list[str]  # ids, as CUDA_VISIBLE_DEVICES names them here
    uuids: dict[str, str]  # id -> UUID (a GPU missing here cannot be leased)
    fake: bool = False


def fake(count: int) -> Inventory:
    gpus = [str(i) for i in range(count)]
    return Inventory(gpus, {g: f"GPU-fake-{g}" for g in gpus}, fake=True)


def detect(requested: str, detect_ids: Callable[[str], list[str]] | None = None) -> Inventory:
    """``--gpus``: ``fake:N``, or what ``detect_ids`` finds (auto, none, a list) with the
    UUIDs nvidia-smi reports for them."""
    match = _FAKE.fullmatch(requested.strip())
    if match:
        return fake(int(match[1]))
    if requested.strip().startswith("fake"):
        raise ValueError(f"--gpus {requested!r}: a test inventory is fake:N (like fake:8)")
    ids = (detect_ids or detect_gpus)(requested)
    return Inventory(ids, resolve_uuids(ids, _smi_uuids()))


def resolve_uuids(ids: list[str], by_index: dict[str, str]) -> dict[str, str]:
    """Each id's UUID: an id that is a UUID already is its own; an index is looked up."""
    out = {}
    for gpu in ids:
        if gpu.startswith(("GPU-", "MIG-")):
            out[gpu] = gpu
        elif gpu in by_index:
            out[gpu] = by_index[gpu]
    return out


def _smi_uuids() -> dict[str, str]:
    """index -> UUID of the GPUs nvidia-smi sees here ({} without nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        listing = subprocess.run(
            [smi, "--query-gpu=index,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (subprocess.SubprocessError, OSError):
        return {}
    out = {}
    for line in listing.stdout.splitlines():
        index, _, uuid = (part.strip() for part in line.partition(","))
        if index and uuid:
            out[index] = uuid
    return out


def detect_gpus(requested: str) -> list[str]:
    """``--gpus``: ``auto`` (CUDA_VISIBLE_DEVICES, else nvidia-smi), ``none``, or a list."""
    if requested == "none":
        return []
    if requested != "auto":
        return [g.strip() for g in requested.split(",") if g.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=20, check=True
        )
    except (subprocess.SubprocessError, OSError):
        return []
    return [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU ")]
