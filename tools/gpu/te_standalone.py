"""Run ``workers.te_attention`` cases under plain torchrun, without cpq, and time the parts.

Why this exists: it proves the TE worker on real GPUs before cpq can host it, and it
measures where the time of the old one-case-per-torchrun workflow goes (interpreter and
torch import, ``import transformer_engine.pytorch``, NCCL init, first case with its kernel
warm-up, warm cases), which is the saving cpq's warm groups are meant to collect.

    torchrun --standalone --nproc-per-node 2 tools/gpu/te_standalone.py \
        [--cases all|first|0,3,5] [--budget-s 150] [--json out.json]

Between cases each rank resets state the way a cpq worker does (seed, TE FP8 state,
attention-backend cache, CUDA cache). With ``--repeat-first`` the first case runs again at
the end and ``state_fingerprint()`` is taken before and after, to show that a case gives the
same result first and after the others. ``TE_STANDALONE_T0`` (seconds since the epoch, set
by the shell before ``torchrun``) lets rank 0 report launch overhead too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_T_MAIN = time.time()  # epoch seconds at the top of this script (after interpreter start)
# Epoch stamps of this rank's milestones; consecutive differences cover the whole process, so
# a caller that knows when it launched torchrun and when torchrun exited can split the wall.
_STAMPS: dict[str, float] = {"script_start": _T_MAIN}
REPO = Path(__file__).resolve().parents[2]

# Representative cases first (format x comm x mask x dtype x GQA), so a time budget that
# stops early still covers every axis; the rest of CASES follows.
REPRESENTATIVE = [
    "cp_1_0-bf16-bshd-p2p-causal",
    "cp_1_0-bf16-sbhd-all_gather-causal",
    "cp_1_0-bf16-thd-p2p-causal",
    "cp_1_0-bf16-bshd-a2a-no_mask",
    "cp_1_0-fp16-sbhd-a2a-causal",
    "cp_2_0-bf16-thd-all_gather-causal",
]


def _reset_like_cpq(seed: int = 1234) -> None:
    """What cpq's worker does before every task, so these numbers match cpq's."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "FP8GlobalStateManager"):
            module.FP8GlobalStateManager.reset()
            break
    dpa = sys.modules.get(
        "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
    )
    cache = getattr(dpa, "_attention_backends", None)
    if isinstance(cache, dict):
        cache["backend_selection_requires_update"] = True


def _pick(cases: list[dict[str, Any]], spec: str, case_id: Any) -> list[dict[str, Any]]:
    by_id = {case_id(c): c for c in cases}
    if spec == "first":
        return [by_id[REPRESENTATIVE[0]]]
    if spec == "all":
        head = [by_id[i] for i in REPRESENTATIVE if i in by_id]
        return head + [c for c in cases if case_id(c) not in REPRESENTATIVE]
    chosen = []
    for part in spec.split(","):
        chosen.append(cases[int(part)] if part.isdigit() else by_id[part])
    return chosen


def _run_one(fn: Any, case: dict[str, Any]) -> dict[str, Any]:
    """Run one case on this rank; classify like cpq (passed / skipped / failed)."""
    import pytest
    import torch

    _reset_like_cpq()
    t0 = time.perf_counter()
    row: dict[str, Any] = {}
    try:
        value = fn(**case)
        row = {"outcome": "passed", "value": value}
    except pytest.skip.Exception as exc:
        row = {"outcome": "skipped", "reason": str(exc)}
    except Exception as exc:
        row = {
            "outcome": "failed",
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-3000:],
        }
    torch.cuda.synchronize()
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="all", help="all | first | comma list of index/id")
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no case after")
    parser.add_argument("--repeat-first", action="store_true")
    parser.add_argument("--json", default="", help="rank 0 writes results here")
    args = parser.parse_args()

    marks: dict[str, float] = {}
    t = time.perf_counter()
    import torch
    import torch.distributed as dist

    marks["import_torch_s"] = time.perf_counter() - t
    _STAMPS["torch_imported"] = time.time()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    _STAMPS["cuda_device_set"] = time.time()

    t = time.perf_counter()
    import transformer_engine.pytorch  # noqa: F401

    marks["import_te_s"] = time.perf_counter() - t
    _STAMPS["te_imported"] = time.time()

    t = time.perf_counter()
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    dist.barrier(device_ids=[local_rank])  # NCCL communicators are created lazily: force it
    torch.cuda.synchronize()
    marks["init_process_group_s"] = time.perf_counter() - t
    _STAMPS["process_group_ready"] = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()

    sys.path.insert(0, str(REPO))
    from workers import te_attention as w

    cases = _pick(w.CASES, args.cases, w.case_id)
    fingerprint_before = w.state_fingerprint()
    _STAMPS["cases_start"] = time.time()
    t_cases = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in cases:
        # every rank must agree on whether to start the next case
        in_budget = time.perf_counter() - t_cases < args.budget_s
        go = torch.tensor([int(in_budget)], device="cuda", dtype=torch.int32)
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if not bool(go.item()):
            break
        row = _run_one(w.run_dpa_with_cp, case)
        row["case"] = w.case_id(case)
        rows.append(row)
        if rank == 0:
            print(f"[te_standalone] {row['case']}: {row['outcome']} {row['wall_s']} s", flush=True)
    repeat = None
    if args.repeat_first and cases:
        repeat = _run_one(w.run_dpa_with_cp, cases[0])
        repeat["case"] = w.case_id(cases[0])
    _STAMPS["cases_end"] = time.time()
    fingerprint_after = w.state_fingerprint()

    all_marks: list[Any] = [None] * world
    dist.all_gather_object(all_marks, marks)
    all_stamps: list[Any] = [None] * world
    dist.all_gather_object(all_stamps, _STAMPS)
    marks["script_start_after_t0_s"] = (
        _T_MAIN - float(os.environ["TE_STANDALONE_T0"]) if "TE_STANDALONE_T0" in os.environ else -1
    )
    if rank == 0:
        extra = {"stamps": all_stamps, "t0": float(os.environ.get("TE_STANDALONE_T0") or -1)}
        _report(
            all_marks, marks, rows, repeat, fingerprint_before, fingerprint_after, args.json, extra
        )
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()
    failed = any(r["outcome"] == "failed" for r in rows)
    return 1 if failed else 0


def _report(
    all_marks: list[Any],
    marks: dict[str, float],
    rows: list[dict[str, Any]],
    repeat: dict[str, Any] | None,
    before: dict[str, Any],
    after: dict[str, Any],
    json_path: str,
    extra: dict[str, Any] | None = None,
) -> None:
    """Print the per-case table and the start-up breakdown; optionally write JSON.

    ``extra`` goes into the JSON as is: per-rank epoch ``stamps`` and the launch time ``t0``,
    which ``tools/bench_te.py`` uses to split one torchrun's wall into its parts.
    """
    print("\n=== start-up (per rank, seconds) ===")
    for r, m in enumerate(all_marks):
        print(f"rank {r}: " + ", ".join(f"{k}={v:.2f}" for k, v in m.items()))
    if marks["script_start_after_t0_s"] >= 0:
        print(f"torchrun launch -> script start (rank 0): {marks['script_start_after_t0_s']:.2f} s")
    print("\n=== cases (world size 2) ===")
    header = f"{'case':44} {'outcome':8} {'wall_s':>7} {'cp_ms':>8} {'ref_ms':>8}  max|err| / note"
    print(header)
    print("-" * len(header))
    for row in rows + ([dict(repeat, case=repeat["case"] + " (again)")] if repeat else []):
        value = row.get("value") or {}
        if row["outcome"] == "passed":
            errs = value.get("max_abs_err", {})
            note = " ".join(f"{k}={v:.1e}" for k, v in errs.items()) + f" [{value.get('backend')}]"
        else:
            note = (row.get("reason") or row.get("error") or "")[:160].replace("\n", " ")
        print(
            f"{row['case']:44} {row['outcome']:8} {row['wall_s']:7.2f} "
            f"{value.get('cp_ms', float('nan')):8.3f} {value.get('ref_ms', float('nan')):8.3f}"
            f"  {note}"
        )
    for row in rows:
        if row["outcome"] == "failed":
            print(f"\n--- {row['case']} traceback (rank 0) ---\n{row.get('traceback', '')}")
    if repeat is not None and rows:
        first, again = rows[0].get("value") or {}, repeat.get("value") or {}
        same = first.get("max_abs_err") == again.get("max_abs_err")
        print(f"\nfirst case again after {len(rows) - 1} others: max|err| identical: {same}")
    print("\nstate_fingerprint before:", json.dumps(before, sort_keys=True))
    print("state_fingerprint after: ", json.dumps(after, sort_keys=True))
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {
                    "marks": all_marks,
                    "rows": rows,
                    "repeat": repeat,
                    "fingerprint_before": before,
                    "fingerprint_after": after,
                    **(extra or {}),
                },
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
