"""CPU stand-in for TE's ``run_attention_with_cp_pool.py``: the same stdio protocol, gloo.

One ``torchrun`` per pytest session and world size; rank 0 reads one JSON request line
from stdin, broadcasts it, every rank runs ``run_dpa_with_cp(**kwargs)`` with
``NVTE_CP_POOL_PG=1`` and the pool's CP group, results are gathered and rank 0 writes one
JSON line (``{"ok": true}`` or ``{"ok": false, "error": ...}``) to stdout.
"""

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import run_attention_with_cp as rac


def main() -> None:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if rank != 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - lives as long as the rank
    dist.init_process_group(backend="gloo")
    os.environ["NVTE_CP_POOL_PG"] = "1"
    rac._pool_cp_comm_group = dist.new_group(range(world_size))
    try:
        while True:
            box = [None]
            if rank == 0:
                line = sys.stdin.readline()
                box[0] = {"op": "shutdown"} if not line else json.loads(line)
            dist.broadcast_object_list(box, src=0)
            req = box[0]
            if req.get("op") == "shutdown":
                break
            torch.manual_seed(1234)
            t0 = time.monotonic()
            ok, err = True, ""
            try:
                rac.run_dpa_with_cp(**req.get("kwargs", {}))
            except Exception:
                ok, err = False, f"[Rank {rank}] {traceback.format_exc()}"
            if rank == 0 and int(os.environ.get("NVTE_CP_POOL_TIMING", "0")):
                sys.stderr.write(f"[POOL-TIMING] wall_s={time.monotonic() - t0:.3f} ok={ok}\n")
                sys.stderr.flush()
            gathered = [None] * world_size
            dist.gather_object((ok, err), gathered if rank == 0 else None, dst=0)
            if rank == 0:
                if all(o for o, _ in gathered):
                    sys.stdout.write(json.dumps({"ok": True}) + "\n")
                else:
                    first = next(m for o, m in gathered if not o)
                    sys.stdout.write(json.dumps({"ok": False, "error": first}) + "\n")
                sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
