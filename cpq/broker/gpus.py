"""The GPUs a broker may use: ``--gpus auto|none|0,1,...``."""

from __future__ import annotations

import os
import shutil
import subprocess


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
