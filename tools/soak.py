"""Soak: many clients, many tasks, random faults; every task must get exactly its verdict.

Starts a private ``cpq-broker`` (``--heartbeat 0.5 --liveness 4``, so a silent rank is dead
after 2 s) and runs ``--clients`` threads, each with its own :class:`cpq.Client`, that
submit ``--tasks`` tasks each to ws=2 gloo groups, ``--window`` in flight at a time. A
seeded fraction ``--fault-rate`` of the tasks are fault injectors from
``workers/faults.py``, picked uniformly; the rest are ``workers.collectives:echo`` calls
whose return value must be exactly their own arguments (so a mixed-up or duplicated
verdict shows). Faults that are infrastructure failures strike once (``once_marker``):
attempt 1 dies, the retry must pass with a ``[CPQ-RETRY]`` note. Faults that are real
failures must come back ``failed`` without a retry.

Checked at the end: every task got exactly one verdict (lost = 0: no future left
unresolved; duplicated = 0: no second ``done`` for a task id), every verdict is the
expected one, no process of this run survives the broker (psutil: no ``cpq.rank`` or
``cpq.rank.launch`` process whose environment names this run's backend socket), and the
broker's RSS stays flat (after warm-up vs the end). Exit status 0 only if all hold.

Usage::

    python tools/soak.py                                   # 3 clients x 3,500 tasks
    python tools/soak.py --clients 2 --tasks 40 --fault-rate 0.1 --json out.json

RELIABILITY.md records a run's figures (``--json`` writes them all).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpq import Client, TaskResult, protocol  # noqa: E402
from cpq.client.autostart import spawn_broker, stop_broker  # noqa: E402

WS = 2
ECHO = "workers.collectives:echo"
HEARTBEAT, LIVENESS = 0.5, 4
#: The deadline of the hanging faults: short, but not so short that a starved CPU trips it.
HANG_DEADLINE_S = 5.0


@dataclass(frozen=True)
class Fault:
    """One injector: how to call it, and the verdict it must get."""

    kind: str
    target: str
    kwargs: dict[str, Any]
    outcome: str  # the expected final outcome
    retried: bool  # an infra failure: attempt 1 dies, attempt 2 passes
    timeout: float = 60.0
    marker: bool = False  # needs a once_marker


FAULTS = [
    Fault("sigkill", "workers.faults:sigkill", {}, "passed", True, marker=True),
    Fault("sigstop", "workers.faults:sigstop", {}, "passed", True, marker=True),
    Fault("segfault", "workers.faults:segfault", {}, "passed", True, marker=True),
    Fault("os_exit_3", "workers.faults:exit_code", {"code": 3}, "passed", True, marker=True),
    Fault("hang_in_collective", "workers.faults:hang_in_collective", {}, "passed", True,
          timeout=HANG_DEADLINE_S, marker=True),
    Fault("hang_in_python", "workers.faults:spin_in_python", {}, "passed", True,
          timeout=HANG_DEADLINE_S, marker=True),
    Fault("raise_while_peer_waits", "workers.faults:raise_while_peer_waits", {}, "failed", False),
    Fault("flood_output", "workers.faults:flood_output", {"megabytes": 4, "stderr": True},
          "passed", False),
    Fault("unserialisable_return", "workers.faults:unserialisable_return", {}, "failed", False),
    Fault("leak_memory", "workers.faults:leak_memory", {"megabytes": 16}, "passed", False),
    Fault("mutate_global_state", "workers.faults:mutate_global_state", {}, "passed", False),
    Fault("exhaust_fds", "workers.faults:exhaust_fds", {"limit": 1024}, "passed", False),
]  # fmt: skip
BAD_RETURNS = ["object", "int_keys", "deep"]


@dataclass
class Planned:
    client: int
    index: int
    kind: str  # "echo" or a Fault.kind
    target: str
    kwargs: dict[str, Any]
    timeout: float
    expected: str
    retried: bool


@dataclass
class Outcome:
    planned: Planned
    result: TaskResult | None = None
    error: str = ""
    future: Future[TaskResult] | None = None

    def problem(self) -> str:
        """Why this verdict is not the expected one ("" when it is)."""
        p, r = self.planned, self.result
        if r is None:
            return f"no verdict: {self.error or 'lost'}"
        if r.outcome != p.expected:
            return f"outcome {r.outcome}, expected {p.expected}: {r.message[:300]!r}"
        retry_notes = [n for n in r.notes if n.startswith(protocol.RETRY_NOTE)]
        if p.retried:
            if r.attempts != 2 or len(retry_notes) != 1:
                return f"expected one retry, got attempts={r.attempts} notes={r.notes!r}"
        elif r.attempts != 1 or r.notes:
            return f"unexpected retry: attempts={r.attempts} notes={[n[:200] for n in r.notes]}"
        if p.kind == "echo" and [x.value for x in r.ranks] != [p.kwargs] * WS:
            return f"wrong values {[x.value for x in r.ranks]!r} for {p.kwargs!r}"
        return ""


class CountingClient(Client):
    """Counts every ``done`` frame per task id: a second one is a duplicated verdict."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.done_frames: Counter[str] = Counter()
        super().__init__(*args, **kwargs)

    def _on_frame(self, frame: bytes) -> bool:
        try:
            message = protocol.decode(frame)
        except protocol.ProtocolError:
            message = None
        if isinstance(message, protocol.Done):
            self.done_frames[message.result.task_id] += 1
        return super()._on_frame(frame)  # False for junk: no sign of a live broker


@dataclass
class Report:
    command: str
    started: str
    seconds: float = 0.0
    clients: int = 0
    tasks_per_client: int = 0
    tasks: int = 0
    fault_rate: float = 0.0
    seed: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    expected_ok: int = 0
    unexpected: list[str] = field(default_factory=list)
    retries: int = 0
    retried_tasks: int = 0
    respawns: int = 0
    groups_recycled: int = 0
    lost: int = 0
    duplicated: int = 0
    orphans: int = 0
    orphan_cmdlines: list[str] = field(default_factory=list)
    broker_rss_start_mb: float = 0.0
    broker_rss_end_mb: float = 0.0
    broker_rss_flat: bool = True
    broker_totals: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    kept: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.unexpected
            and self.lost == 0
            and self.duplicated == 0
            and self.orphans == 0
            and self.broker_rss_flat
            and self.expected_ok == self.tasks
        )


def plan(clients: int, tasks: int, fault_rate: float, seed: int, markers: Path) -> list[Planned]:
    rng = random.Random(seed)
    planned = []
    for c in range(clients):
        for i in range(tasks):
            if rng.random() < fault_rate:
                fault = rng.choice(FAULTS)
                kwargs = dict(fault.kwargs)
                if fault.marker:
                    kwargs["once_marker"] = str(markers / f"c{c}-t{i}-{fault.kind}")
                if fault.kind == "unserialisable_return":
                    kwargs["kind"] = rng.choice(BAD_RETURNS)
                planned.append(
                    Planned(c, i, fault.kind, fault.target, kwargs, fault.timeout,
                            fault.outcome, fault.retried)
                )  # fmt: skip
            else:
                kwargs = {"client": c, "index": i}
                planned.append(Planned(c, i, "echo", ECHO, kwargs, 60.0, "passed", False))
    return planned


def run_client(
    endpoint: str, mine: list[Planned], window: int, outcomes: list[Outcome], dup: list[int]
) -> None:
    in_flight: deque[tuple[Outcome, Future[TaskResult]]] = deque()

    def settle(outcome: Outcome, future: Future[TaskResult]) -> None:
        try:
            outcome.result = future.result(timeout=600)
        except Exception as exc:  # a verdict that never came is a lost task
            outcome.error = f"{type(exc).__name__}: {exc}"

    with CountingClient(endpoint, name="soak") as client:
        for planned in mine:
            if len(in_flight) >= window:
                settle(*in_flight.popleft())
            outcome = Outcome(planned)
            outcomes.append(outcome)
            future = client.submit_async(
                planned.target, WS, planned.kwargs, timeout=planned.timeout,
                roots=[str(ROOT)], test_id=f"soak::{planned.kind}",
            )  # fmt: skip
            outcome.future = future
            in_flight.append((outcome, future))
        while in_flight:
            settle(*in_flight.popleft())
        time.sleep(2 * HEARTBEAT)  # a late duplicate would arrive by now
        dup.append(sum(n - 1 for n in client.done_frames.values() if n > 1))


def start_broker(state: Path, max_ranks: int) -> tuple[subprocess.Popen[bytes], str]:
    state.mkdir(mode=0o700, parents=True)
    endpoint = f"ipc://{state / 'broker.sock'}"
    env = dict(os.environ, CPQ_STATE_DIR=str(state), PYTHONPATH=str(ROOT))
    env.pop("CPQ_ENDPOINT", None)
    args = ["--gpus", "none", "--max-ranks", str(max_ranks), "--heartbeat", str(HEARTBEAT),
            "--liveness", str(LIVENESS), "--max-rss-growth", "256"]  # fmt: skip
    process = spawn_broker(endpoint, args, env=env, log_path=state / "broker.stdout", cwd=ROOT)
    return process, endpoint


def processes_of_run(state: Path) -> list[psutil.Process]:
    """Every process started for this run: a group agent or rank whose environment names
    this run's backend socket (other brokers' workers on the node are not ours)."""
    mine = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "cpq.rank" not in cmdline:
            continue
        try:
            backend = proc.environ().get("CPQ_BACKEND_ENDPOINT", "")
        except psutil.Error:
            continue
        if str(state) in backend:
            mine.append(proc)
    return mine


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:200]
    except psutil.Error:
        return f"pid {proc.pid} (gone)"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def soak(
    clients: int = 3,
    tasks: int = 3500,
    fault_rate: float = 0.05,
    seed: int = 20261129,
    window: int = 16,
    max_ranks: int = 6,
    verbose: bool = True,
) -> Report:
    command = (
        f"python tools/soak.py --clients {clients} --tasks {tasks} --fault-rate {fault_rate} "
        f"--seed {seed} --window {window} --max-ranks {max_ranks}"
    )
    report = Report(command=command, started=datetime.datetime.now().isoformat(timespec="seconds"))
    report.clients, report.tasks_per_client, report.fault_rate, report.seed = (
        clients, tasks, fault_rate, seed,
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="cpq-soak-"))
    state, markers = work / "state", work / "markers"
    markers.mkdir()
    planned = plan(clients, tasks, fault_rate, seed, markers)
    report.tasks = len(planned)
    report.faults = dict(sorted(Counter(p.kind for p in planned if p.kind != "echo").items()))
    started = time.monotonic()
    process, endpoint = start_broker(state, max_ranks)
    broker = psutil.Process(process.pid)
    outcomes: list[list[Outcome]] = [[] for _ in range(clients)]
    duplicates: list[int] = []
    try:
        with Client(endpoint, name="soak-monitor") as monitor:
            monitor.warm([_spec()], [min(clients, max_ranks // WS)])
            threads = [
                threading.Thread(
                    target=run_client,
                    args=(
                        endpoint,
                        [p for p in planned if p.client == c],
                        window,
                        outcomes[c],
                        duplicates,
                    ),
                    name=f"soak-client-{c}",
                )
                for c in range(clients)
            ]
            for thread in threads:
                thread.start()
            warm_after = max(1, report.tasks // 10)
            last_print = 0.0
            while any(t.is_alive() for t in threads):
                done = sum(1 for o in outcomes for x in o if x.future and x.future.done())
                if not report.broker_rss_start_mb and done >= warm_after:
                    report.broker_rss_start_mb = broker.memory_info().rss / 2**20
                if verbose and time.monotonic() - last_print > 10:
                    last_print = time.monotonic()
                    totals = monitor.status()["totals"]
                    print(
                        f"[{time.monotonic() - started:6.0f}s] {done}/{report.tasks} done, "
                        f"groups started {totals['groups_started']}, "
                        f"retries {totals['retries']}",
                        flush=True,
                    )
                time.sleep(0.2)
            for thread in threads:
                thread.join()
            report.broker_rss_end_mb = broker.memory_info().rss / 2**20
            if not report.broker_rss_start_mb:
                report.broker_rss_start_mb = report.broker_rss_end_mb
            status = monitor.status()
            report.broker_totals = status["totals"]
    finally:
        stop_broker(process)
    report.seconds = time.monotonic() - started
    # Orphans: give the process tree a moment to finish dying, then look.
    deadline = time.monotonic() + 15
    leftover = processes_of_run(state)
    while leftover and time.monotonic() < deadline:
        time.sleep(0.2)
        leftover = [p for p in leftover if _alive(p)]
    report.orphans = len(leftover)
    report.orphan_cmdlines = [_cmdline(p) for p in leftover]
    for proc in leftover:
        with contextlib.suppress(psutil.Error):
            proc.kill()

    flat = [o for per_client in outcomes for o in per_client]
    report.lost = sum(1 for o in flat if o.result is None) + (report.tasks - len(flat))
    report.duplicated = sum(duplicates)
    report.verdicts = dict(
        sorted(Counter(o.result.outcome if o.result else "lost" for o in flat).items())
    )
    report.retried_tasks = sum(1 for o in flat if o.result and o.result.attempts > 1)
    problems = [(o, o.problem()) for o in flat]
    report.expected_ok = sum(1 for _, why in problems if not why)
    report.unexpected = [
        f"client {o.planned.client} task {o.planned.index} ({o.planned.kind}): {why}"
        for o, why in problems
        if why
    ]
    totals = report.broker_totals
    report.retries = int(totals.get("retries", 0))
    report.respawns = int(totals.get("groups_started", 0))
    report.groups_recycled = int(totals.get("groups_recycled", 0))
    growth = report.broker_rss_end_mb - report.broker_rss_start_mb
    # Flat: within 10 % (or 10 MB) of the post-warm-up figure; judged on long runs only.
    report.broker_rss_flat = report.tasks < 1000 or growth <= max(
        10.0, 0.1 * report.broker_rss_start_mb
    )
    report.machine = machine()
    if report.ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        report.kept = str(work)  # the broker's and every group's logs, for a post-mortem
    return report


def _spec() -> Any:
    from cpq.specs import make_spec

    return make_spec(WS, None, [str(ROOT)])


def table(report: Report) -> str:
    rows = [
        ("tasks", f"{report.tasks} ({report.clients} clients x {report.tasks_per_client})"),
        ("faults injected", f"{sum(report.faults.values())} (rate {report.fault_rate:g})"),
        *((f"  {kind}", str(n)) for kind, n in report.faults.items()),
        ("verdicts", ", ".join(f"{k} {v}" for k, v in report.verdicts.items())),
        ("expected verdicts", f"{report.expected_ok} / {report.tasks}"),
        ("retries (broker)", str(report.retries)),
        ("tasks that needed a retry", str(report.retried_tasks)),
        ("groups started (respawns)", str(report.respawns)),
        ("groups recycled", str(report.groups_recycled)),
        ("lost", str(report.lost)),
        ("duplicated", str(report.duplicated)),
        ("orphan processes", str(report.orphans)),
        ("broker RSS after warm-up", f"{report.broker_rss_start_mb:.1f} MB"),
        ("broker RSS at end", f"{report.broker_rss_end_mb:.1f} MB"),
        ("wall time", f"{report.seconds:.0f} s"),
        ("result", "PASS" if report.ok else "FAIL"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=3500, help="tasks per client")
    parser.add_argument("--fault-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--window", type=int, default=16, help="tasks in flight per client")
    parser.add_argument("--max-ranks", type=int, default=6, help="the broker's --max-ranks")
    parser.add_argument("--json", type=Path, help="write the full report as JSON here")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    report = soak(
        args.clients, args.tasks, args.fault_rate, args.seed, args.window, args.max_ranks,
        verbose=not args.quiet,
    )  # fmt: skip
    print(table(report))
    for line in report.unexpected[:20]:
        print("UNEXPECTED:", line)
    if report.kept:
        print("logs kept in", report.kept)
    if report.orphan_cmdlines:
        print("ORPHANS:", *report.orphan_cmdlines, sep="\n  ")
    if args.json:
        data = asdict(report)
        data["ok"] = report.ok
        args.json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
