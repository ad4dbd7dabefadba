"""A task that records which GPUs its rank uses and when (GPU lease tests and checks).

``workers.gpu_usage:record`` appends JSON lines to ``path`` while it holds its rank's
"GPUs" for ``hold_s``: one line when it starts and one every ``every_s`` until it ends,
each with the broker ``tag`` the caller names, the group, the rank's pid,
``CUDA_VISIBLE_DEVICES`` and the wall time. A rank that dies mid-task (a chaos run kills
ranks and brokers) leaves its last line as the end of its use, within ``every_s``; so two
groups' lines on one GPU whose time spans overlap mean the GPU was shared.

With a ``fake:N`` inventory no GPU is touched; on real GPUs ``touch=True`` allocates a
little memory on the rank's device so ``nvidia-smi`` lists the rank on it. ``outlive=True``
clears the rank's parent-death signal first, so the rank outlives a SIGKILLed broker and
agent for the rest of its hold (what the lease must survive: a GPU is free only once every
rank that could touch it has exited).

Lines are appended with one ``write`` each (``O_APPEND``), so ranks of several brokers,
under several users, share one file (create it mode 0666).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from typing import Any

import torch.distributed as dist

from cpq.rank import leases


def _append(path: str, row: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def leases_held() -> int:
    """How many of the group's lease descriptors this process holds."""
    held = 0
    for fd, dev, ino in leases.expected():
        try:
            info = os.fstat(fd)
        except OSError:
            continue
        held += (info.st_dev, info.st_ino) == (dev, ino)
    return held


def record(
    path: str,
    tag: str,
    hold_s: float = 0.0,
    every_s: float = 0.05,
    touch: bool = False,
    outlive: bool = False,
) -> dict[str, Any]:
    if outlive:
        ctypes.CDLL(None).prctl(1, 0)  # PR_SET_PDEATHSIG 0: survive the agent
    row = {
        "tag": tag,
        "group": os.environ.get("CPQ_GROUP_ID", ""),
        # Unique per group, also across broker restarts (group ids start at g1 again).
        "group_key": hashlib.sha256(os.environ.get("CPQ_GROUP_TOKEN", "").encode()).hexdigest()[
            :12
        ],
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "leases_held": leases_held(),
        "leases_expected": len(leases.expected()),
    }
    keep: Any = None
    if touch:
        import torch

        keep = torch.ones(64 * 2**20, device="cuda")  # 256 MB: nvidia-smi lists this rank
    start = time.time()
    _append(path, {**row, "t": start, "what": "start"})
    while time.time() - start < hold_s:
        time.sleep(every_s)
        _append(path, {**row, "t": time.time(), "what": "tick"})
    del keep
    if not outlive:
        dist.barrier()
    _append(path, {**row, "t": time.time(), "what": "end"})
    return {**row, "start": start, "end": time.time()}
