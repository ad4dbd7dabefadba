"""The floor of a no-op round trip by message path, with cpq's own frames, against the pool.

Why this exists (issue 34's 0.85x target): cpq's round trip crosses four ZeroMQ hops and
six messages (client → broker → each rank → broker → client), a stdio pool one pipe write
each way plus gloo collectives. Before building another path, this measures what each path
could give at best: every process does only what any design must (decode the frame with
:mod:`cpq.protocol`'s validating decoder, call the no-op, encode the report), with none of
cpq's bookkeeping (no placement, freshness check, reset, capture or history). Three paths,
alternated in blocks in one run, beside ``tools/stdio_pool.py``'s pool:

* ``broker``: client → a forwarder process → both ranks → forwarder → client, the
  forwarder decoding each frame and sending one verdict (today's shape, Python at its floor);
* ``direct``: client → both ranks → client (a client that held its group and sent to its
  ranks itself; the verdict assembled by the client);
* ``pool``: the stdio pool (ws=2 gloo), as ``tools/bench_core.py`` runs it.

Usage: ``python tools/bench_direct.py [--tasks 1000] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402

from cpq import protocol  # noqa: E402
from cpq.protocol import RankResult, TaskResult  # noqa: E402

BLOCK = 100


def noop() -> None:
    """The task."""


def rank_main(endpoint: str, rank: int) -> None:
    """A rank at its floor: decode the run, call the no-op, encode and send the report."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"r{rank}".encode())
    sock.connect(endpoint)
    sock.send(b"ready")
    while True:
        frame = sock.recv()
        if frame == b"quit":
            return
        run = protocol.decode(frame)
        assert isinstance(run, protocol.RunTask)
        start = time.perf_counter()
        noop()
        result = RankResult(rank=rank, outcome="passed", duration_s=time.perf_counter() - start)
        sock.send(protocol.encode(protocol.RankDone(task_id=run.task_id, result=result)))


def forwarder_main(front: str, back: str) -> None:
    """The broker at its floor: a submit becomes a run to each rank, two reports a verdict."""
    context = zmq.Context()
    clients, ranks = context.socket(zmq.ROUTER), context.socket(zmq.ROUTER)
    clients.bind(front)
    ranks.bind(back)
    waiting = {ranks.recv_multipart()[0] for _ in range(2)}  # both ranks said ready
    clients.send_multipart([clients.recv_multipart()[0], b"ready"])
    while True:
        client, frame = clients.recv_multipart()
        if frame == b"quit":
            for rank in waiting:
                ranks.send_multipart([rank, b"quit"])
            return
        submit = protocol.decode(frame)
        assert isinstance(submit, protocol.RunTask)
        run = protocol.encode(submit)
        for rank in sorted(waiting):
            ranks.send_multipart([rank, run])
        reports = [protocol.decode(ranks.recv_multipart()[1]) for _ in range(2)]
        results = [r.result for r in reports if isinstance(r, protocol.RankDone)]
        verdict = TaskResult(task_id=submit.task_id, outcome="passed", ranks=results)
        clients.send_multipart([client, protocol.encode(protocol.Done(verdict))])


def spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, *args])


def run_frame(i: int) -> bytes:
    return protocol.encode(protocol.RunTask(task_id=f"t{i}", target="bench_direct:noop"))


def through_broker(state: Path) -> tuple[zmq.Socket[bytes], list[subprocess.Popen[bytes]]]:
    """A client's socket to a started forwarder and its two ranks, warmed with 50 no-ops."""
    front, back = f"ipc://{state}/front", f"ipc://{state}/back"
    procs = [spawn("--forwarder", front, back)] + [spawn("--rank", back, str(r)) for r in (0, 1)]
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(front)
    sock.send(b"hello")
    assert sock.recv() == b"ready"
    for i in range(50):
        broker_one(sock, i)
    return sock, procs


def broker_one(sock: zmq.Socket[bytes], i: int) -> float:
    t0 = time.perf_counter()
    sock.send(run_frame(i))
    done = protocol.decode(sock.recv())
    assert isinstance(done, protocol.Done) and len(done.result.ranks) == 2
    return time.perf_counter() - t0


def direct(state: Path) -> tuple[Any, list[subprocess.Popen[bytes]]]:
    endpoint = f"ipc://{state}/direct"
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    procs = [spawn("--rank", endpoint, str(r)) for r in (0, 1)]
    ranks = sorted(sock.recv_multipart()[0] for _ in range(2))
    return (sock, ranks), procs


def direct_one(handle: Any, i: int) -> float:
    sock, ranks = handle
    t0 = time.perf_counter()
    frame = run_frame(i)
    for rank in ranks:
        sock.send_multipart([rank, frame])
    results = []
    for _ in ranks:
        report = protocol.decode(sock.recv_multipart()[1])
        assert isinstance(report, protocol.RankDone)
        results.append(report.result)
    TaskResult(task_id=f"t{i}", outcome="passed", ranks=results)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--json")
    parser.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--forwarder", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank_main(args.rank[0], int(args.rank[1]))
    if args.forwarder:
        return forwarder_main(*args.forwarder)
    sys.path.insert(0, str(ROOT / "tools"))
    from bench_core import stdio_pool, stdio_round_trips

    state = Path(tempfile.mkdtemp(prefix="cpq-direct-"))
    pool = stdio_pool()
    times: dict[str, list[float]] = {"broker": [], "direct": [], "pool": []}
    broker_sock, broker_procs = through_broker(state)
    handle, direct_procs = direct(state)
    for i in range(50):
        direct_one(handle, i)
    try:
        for i in range(0, args.tasks, BLOCK):
            n = min(BLOCK, args.tasks - i)
            times["pool"] += stdio_round_trips(pool, n)
            times["broker"] += [broker_one(broker_sock, j) for j in range(i, i + n)]
            times["direct"] += [direct_one(handle, j) for j in range(i, i + n)]
    finally:
        pool.__exit__(None, None, None)
        broker_sock.send(b"quit")
        handle[0].send_multipart([handle[1][0], b"quit"])
        handle[0].send_multipart([handle[1][1], b"quit"])
        for proc in broker_procs + direct_procs:
            proc.wait(timeout=10)
    p50 = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{os.cpu_count()} cores, {args.tasks} no-ops each, p50:")
    for name in ("broker", "direct", "pool"):
        print(f"  {name:7} {p50[name]:.3f} ms   ÷ pool {p50[name] / p50['pool']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"p50_ms": p50, "tasks": args.tasks}))


if __name__ == "__main__":
    main()
