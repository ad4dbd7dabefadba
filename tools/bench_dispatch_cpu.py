"""CPU cost of the dispatch path's pure-Python steps, per task, in this process.

Why this exists (issue 15): a no-op round trip on two loaded cores is dominated by thread
and process wake-ups, which hide what the code itself costs. This times the steps each task
pays in each process, over the real functions: the client building and encoding a submit
(reading the caller's environment, making the pool spec), the broker decoding it, a rank
decoding its ``run``, the client decoding the verdict. Run it in two checkouts, alternated,
to compare code.

Usage: ``python tools/bench_dispatch_cpu.py`` (from the checkout to measure)
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.getcwd())

import cpq.client as client
from cpq import environ, protocol

N = 10000


def per_call_us(function: Callable[[], Any], n: int = N) -> float:
    started = time.perf_counter()
    for _ in range(n):
        function()
    return (time.perf_counter() - started) / n * 1e6


def main() -> int:
    roots = [os.getcwd()]
    split = getattr(client, "caller_environ", None) or (lambda: environ.split(os.environ))

    def submit() -> bytes:
        start, task_env = split()
        spec = client.make_spec(2, None, roots, caller_env=start)
        message = protocol.Submit(
            task_id=uuid.uuid4().hex,
            target="workers.collectives:noop",
            spec=spec,
            timeout=90.0,
            env=task_env,
        )
        return protocol.encode_for(message, protocol.ALL_FEATURES)

    frame = submit()
    _, task_env = environ.split(os.environ)
    run = protocol.encode(protocol.RunTask(task_id="x" * 32, target="m:f", env=task_env))
    ranks = [protocol.RankResult(rank=r, outcome="passed") for r in (0, 1)]
    done = protocol.encode(protocol.Done(protocol.TaskResult("x" * 32, "passed", ranks)))
    print(
        f"{os.getcwd()}: submit build+encode {per_call_us(submit):.0f} | "
        f"decode submit {per_call_us(lambda: protocol.decode(frame)):.0f} | "
        f"decode run {per_call_us(lambda: protocol.decode(run)):.0f} | "
        f"decode done {per_call_us(lambda: protocol.decode(done)):.0f} us per task"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
