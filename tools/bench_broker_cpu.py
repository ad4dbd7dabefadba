"""The broker's own CPU per no-op task, in this process, without sockets or scheduling.

Why this exists: on both the 2-core VM and the 16-core GPU host the no-op round trip of
``tools/bench_core.py`` swings between two modes from run to run (1.25 / 1.7 ms on the VM,
0.87 / 1.8 ms on the H100 host, the same code), which hides any change to the broker's
Python below ~0.2 ms. This drives a real :class:`~cpq.broker.loop.Broker` on the unit
tests' fakes (``tests/unit/fakes.py``: a clock, a group that is "up" at once) through the
messages of one task: the client's submit, each rank's report, with a tick every
``--tick-every`` tasks as the real loop's 50 ms would give at ~1,000 tasks a second; frames
are encoded beforehand and what the broker sends is counted, not decoded. The figure is
``time.thread_time`` per task, the median of ``--repeats`` runs. Run it in two checkouts,
alternated, to compare code.

Usage: ``python tools/bench_broker_cpu.py [--tasks 5000] [--repeats 5] [--spares 1]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "unit")]

from fakes import FakeWire, Sim  # noqa: E402

from cpq import protocol  # noqa: E402
from cpq.protocol import RankResult  # noqa: E402


class CountingWire(FakeWire):
    """Sends are counted, not decoded (the fakes' inspection is not the broker's cost)."""

    sent = 0

    def send_client(self, identity: bytes, message: protocol.Message | bytes) -> None:
        if not isinstance(message, bytes):
            protocol.encode(message)
        self.sent += 1

    def send_rank(self, identity: bytes, frame: bytes) -> bool:
        self.sent += 1
        return True


def one_run(tasks: int, spares: int, tick_every: int) -> float:
    """Seconds of this thread's CPU per task, over ``tasks`` no-op tasks on one ws=2 group."""
    sim = Sim(spares=spares)
    sim.wire = CountingWire()
    sim.broker = type(sim.broker)(sim.config, sim.wire, sim.clock, sim._make_process)
    client = sim.client(features=sorted(protocol.ALL_FEATURES))  # as a real client says
    first = sim.submit(client)
    group = next(iter(sim.broker.pools.groups))
    sim.bring_up(group)
    sim.finish_all(group, first)
    for spare in [g for g in sim.broker.pools.groups if g != group]:
        sim.bring_up(spare)
    submits, reports = [], []
    for i in range(tasks):
        task_id = f"n{i}"
        submit = protocol.Submit(
            task_id=task_id, target="tests.unit.targets:noop", spec=sim_spec(sim)
        )
        submits.append([client, protocol.encode(submit)])
        reports.append(
            [
                [
                    sim.rank_id(group, rank),
                    protocol.encode(
                        protocol.RankDone(
                            task_id=task_id, result=RankResult(rank=rank, outcome="passed")
                        )
                    ),
                ]
                for rank in range(2)
            ]
        )
    controller, broker = sim.broker.controller, sim.broker
    start = time.thread_time()
    for i in range(tasks):
        controller.on_client_frames(submits[i])
        running = broker.pools.groups[group].task
        assert running is not None and running.submit.task_id == f"n{i}", "not dispatched"
        for frames in reports[i]:
            controller.on_rank_frames(frames)
        if i % tick_every == 0:
            sim.clock.advance(0.05)
            broker.tick(sim.clock.monotonic())
    spent = time.thread_time() - start
    assert broker.totals.passed == tasks + 1, broker.totals
    return spent / tasks


def sim_spec(sim: Sim) -> protocol.PoolSpec:
    group = next(iter(sim.broker.pools.groups.values()))
    return group.spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--tick-every", type=int, default=50)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    runs = [one_run(args.tasks, args.spares, args.tick_every) for _ in range(args.repeats)]
    median_us = statistics.median(runs) * 1e6
    print(
        f"broker CPU per no-op task: {median_us:.1f} us (median of {args.repeats} runs of "
        f"{args.tasks}; runs {', '.join(f'{r * 1e6:.1f}' for r in runs)})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"per_task_us": median_us, "runs_us": [r * 1e6 for r in runs]})
        )


if __name__ == "__main__":
    main()
