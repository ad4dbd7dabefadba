"""Baseline "stdio-fed pool": one warm torchrun group per world size, fed JSON on stdin.

Why this exists: it is the scheme Transformer Engine's test suite uses to avoid paying a
torchrun start per case, re-implemented small and faithfully so cpq's benchmarks can be
compared against it. Rank 0 reads one JSON line ``{"id": n, "target": "module:function",
"kwargs": {...}}`` from stdin, broadcasts it (``broadcast_object_list``), every rank
imports and calls the target, outcomes are collected on rank 0 (``gather_object``) and
rank 0 prints one result line prefixed with :data:`RESULT_PREFIX` so the driver can find it
among whatever else the task prints. What it does *not* do is exactly what cpq adds: it is
private to one driver process, has no per-task reset, no liveness beyond "the pipe closed",
and a hung collective hangs the whole pool until the driver's timeout kills it.

Worker (inside torchrun)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/stdio_pool.py --worker

Driver: ``StdioPool(world_size, cwd, env).run(target, kwargs)``, or the CLI
``python tools/stdio_pool.py cases.json`` with a JSON list of
``{"target": ..., "kwargs": {...}, "world_size": N}``. The backend is nccl when CUDA is
visible, else gloo; ``STDIO_POOL_BACKEND`` overrides it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

RESULT_PREFIX = "@@STDIO_POOL_RESULT@@ "
_MAX_ERROR_CHARS = 1500  # keeps a result line short, so it is written to the pipe in one piece


# --------------------------------------------------------------------------------------
# Worker side (runs on every rank inside torchrun)
# --------------------------------------------------------------------------------------


def _call_target(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Import and call the target; classify the outcome the way pytest would."""
    start = time.perf_counter()
    outcome, error, value = "passed", None, None
    try:
        module_name, _, func_name = spec["target"].partition(":")
        func = getattr(importlib.import_module(module_name), func_name)
        value = func(**spec.get("kwargs", {}))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # pytest's Skipped derives from BaseException
        outcome = "skipped" if type(exc).__name__ == "Skipped" else "failed"
        error = {
            "type": type(exc).__name__,
            "message": str(exc)[:_MAX_ERROR_CHARS],
            "traceback": traceback.format_exc()[-_MAX_ERROR_CHARS:] if outcome == "failed" else "",
        }
    return {
        "rank": rank,
        "outcome": outcome,
        "error": error,
        "value": value,
        "duration_s": time.perf_counter() - start,
    }


def _read_request() -> dict[str, Any] | None:
    """Rank 0: next request from stdin, None on EOF; bad lines get an error result line."""
    while True:
        line = sys.stdin.readline()
        if not line:
            return None
        if not line.strip():
            continue
        try:
            spec = json.loads(line)
            if not isinstance(spec, dict) or ":" not in str(spec.get("target", "")):
                raise ValueError("expected {'target': 'module:function', 'kwargs': {...}}")
            return spec
        except ValueError as exc:
            _emit({"id": None, "outcome": "error", "error": f"bad request: {exc}", "ranks": []})


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(result, default=repr) + "\n")
    sys.stdout.flush()


def worker_main() -> None:
    """Init the process group once, then serve requests until stdin closes."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.getcwd())  # targets are imported relative to the driver's cwd
    backend = os.environ.get("STDIO_POOL_BACKEND") or (
        "nccl" if torch.cuda.is_available() else "gloo"
    )
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        while True:
            box: list[Any] = [_read_request() if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            spec = box[0]
            if spec is None:
                break
            mine = _call_target(spec, rank)
            everyone: list[Any] | None = [None] * ws if rank == 0 else None
            dist.gather_object(mine, everyone, dst=0)
            if rank == 0:
                assert everyone is not None
                outcomes = {r["outcome"] for r in everyone}
                overall = next(o for o in ("failed", "skipped", "passed") if o in outcomes)
                _emit(
                    {
                        "id": spec.get("id"),
                        "outcome": overall,
                        "value": everyone[0]["value"],
                        "ranks": everyone,
                    }
                )
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------


class StdioPool:
    """One torchrun group of ``world_size`` ranks, kept alive and fed over stdin.

    ``run`` is synchronous: one case at a time per pool, as in TE. Lines on stdout that are
    not results (task prints) are collected into the result's ``stdout``.
    """

    def __init__(
        self,
        world_size: int,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        stderr: int | None = None,
    ) -> None:
        self.world_size = world_size
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world_size}",
            os.path.abspath(__file__),
            "--worker",
        ]
        self._proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            bufsize=1,
            start_new_session=True,  # lets close()/timeouts kill torchrun and every rank
        )
        self._next_id = 0
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF: the group exited

    def run(
        self, target: str, kwargs: dict[str, Any] | None = None, timeout: float = 300.0
    ) -> dict[str, Any]:
        """Run ``target(**kwargs)`` on every rank; returns the result dict rank 0 printed."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"pool (ws={self.world_size}) exited rc={self._proc.returncode}")
        assert self._proc.stdin is not None
        start = time.perf_counter()
        self._next_id += 1
        request = {"id": self._next_id, "target": target, "kwargs": kwargs or {}}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        other: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(f"{target} did not finish in {timeout}s; pool killed") from None
            if line is None:
                rc = self._proc.wait()
                raise RuntimeError(f"pool (ws={self.world_size}) died during {target}, rc={rc}")
            if line.startswith(RESULT_PREFIX):
                result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
                if result.get("id") != self._next_id:
                    # A stale answer (e.g. to a malformed line someone else wrote): the
                    # id keeps one stray line from shifting every later result by one.
                    other.append(line.rstrip("\n"))
                    continue
                result["wall_s"] = time.perf_counter() - start
                result["stdout"] = other
                return result
            other.append(line.rstrip("\n"))

    def close(self, kill: bool = False, timeout: float = 30.0) -> None:
        """Close stdin (ranks exit their loop); kill the group if asked or if it lingers."""
        if self._proc.poll() is None and not kill:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                kill = True
        if self._proc.poll() is None or kill:
            self._kill()
        self._proc.wait()

    def _kill(self) -> None:
        """Kill torchrun and its ranks.

        torchrun starts every rank in its own session, so killing torchrun's process group
        misses them, and SIGKILL would stop torchrun from passing a signal on. So: note the
        ranks' pids (psutil, a cpq dependency, when present), SIGTERM torchrun (which
        forwards it), then SIGKILL whatever is left after a grace period.
        """
        ranks: list[Any] = []
        try:
            import psutil

            ranks = psutil.Process(self._proc.pid).children(recursive=True)
        except Exception:  # psutil missing or torchrun already gone
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        for rank in ranks:
            with contextlib.suppress(Exception):
                rank.kill()

    def __enter__(self) -> StdioPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """CLI: ``--worker`` inside torchrun, otherwise drive cases from a JSON file (or '-')."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run as a torchrun rank")
    parser.add_argument("cases", nargs="?", help="JSON list of {target, kwargs, world_size}")
    parser.add_argument("--world-size", type=int, default=2, help="default world size")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return 0
    if not args.cases:
        parser.error("give a cases file (or '-' for stdin)")
    with open(args.cases) if args.cases != "-" else sys.stdin as fh:
        cases: list[dict[str, Any]] = json.load(fh)
    pools: dict[int, StdioPool] = {}
    counts: dict[str, int] = {}
    start = time.perf_counter()
    try:
        for case in cases:
            ws = int(case.get("world_size", args.world_size))
            if ws not in pools:
                pools[ws] = StdioPool(ws, cwd=os.getcwd())
            res = pools[ws].run(case["target"], case.get("kwargs", {}), timeout=args.timeout)
            counts[res["outcome"]] = counts.get(res["outcome"], 0) + 1
            print(json.dumps({"case": case, **res}, default=repr), flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    total = time.perf_counter() - start
    print(json.dumps({"summary": counts, "total_s": total}), flush=True)
    return 1 if counts.get("failed") or counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
