"""One hop's round trip between two processes: a pipe against a ZeroMQ DEALER/ROUTER pair.

Why this exists: the no-op dispatch round trip (``tools/bench_core.py``) is two ZeroMQ hops
(client <-> broker <-> ranks) against the stdio pool's one pipe hop, and on the H200 host it
measured 1.2-1.7x the pool while on the 2-core VM it measured 0.84-0.95x. This separates
what one hop costs on a host from what cpq does per task: the same 64-byte ping-pong over a
pipe pair, over ``ipc://`` with blocking receives, and over ``ipc://`` where the waiting side
polls without blocking for up to ``--spin-us`` before it blocks (a core kept awake answers
without a wake-up from a deep idle state).

Usage: ``python tools/bench_hop.py [--rounds 5000] [--spin-us 200] [--json FILE]``.
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
from typing import Any

PAYLOAD = b"x" * 64


def _spin_recv(sock: Any, spin_s: float) -> bytes:
    import zmq

    if spin_s > 0:
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            try:
                return bytes(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                pass
    return bytes(sock.recv())


def child(mode: str, arg: str, spin_s: float) -> None:
    if mode == "pipe":
        rfd, wfd = (int(x) for x in arg.split(","))
        while True:
            data = os.read(rfd, 64)
            if not data:
                return
            os.write(wfd, data)
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(arg)
    sock.send(b"hello")
    while True:
        data = _spin_recv(sock, spin_s)
        if data == b"bye":
            return
        sock.send(data)


def pipe_round_trips(rounds: int) -> list[float]:
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", "pipe", f"{to_child_r},{from_child_w}"],
        pass_fds=(to_child_r, from_child_w),
    )
    os.close(to_child_r)
    os.close(from_child_w)
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        os.write(to_child_w, PAYLOAD)
        os.read(from_child_r, 64)
        out.append(time.perf_counter() - t)
    os.close(to_child_w)
    proc.wait()
    return out


def zmq_round_trips(rounds: int, spin_s: float) -> list[float]:
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='cpq-hop-')}/hop.sock"
    router.bind(endpoint)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", "zmq", endpoint, "--spin-us", str(spin_s * 1e6)]
    )
    identity, _ = router.recv_multipart()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        router.send_multipart([identity, PAYLOAD])
        if spin_s > 0:
            end = time.perf_counter() + spin_s
            got = False
            while not got and time.perf_counter() < end:
                try:
                    router.recv_multipart(zmq.NOBLOCK)
                    got = True
                except zmq.Again:
                    pass
            if not got:
                router.recv_multipart()
        else:
            router.recv_multipart()
        out.append(time.perf_counter() - t)
    router.send_multipart([identity, b"bye"])
    proc.wait()
    router.close(0)
    ctx.term()
    return out


def summary_us(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered) * 1e6,
        "p90": ordered[int(len(ordered) * 0.9)] * 1e6,
        "p99": ordered[int(len(ordered) * 0.99)] * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--spin-us", type=float, default=200.0)
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "ARG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.spin_us / 1e6)
        return 0
    results = {
        "cpus": os.cpu_count(),
        "pipe": summary_us(pipe_round_trips(args.rounds)),
        "zmq ipc, blocking": summary_us(zmq_round_trips(args.rounds, 0.0)),
        f"zmq ipc, spin {args.spin_us:.0f} us": summary_us(
            zmq_round_trips(args.rounds, args.spin_us / 1e6)
        ),
    }
    print(f"one hop's round trip, {args.rounds} rounds, {os.cpu_count()} CPUs (us)")
    for name, row in results.items():
        if isinstance(row, dict):
            cells = "  ".join(f"{q} {row[q]:8.1f}" for q in ("p50", "p90", "p99"))
            print(f"  {name:<28} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
