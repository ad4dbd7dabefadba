"""``cpq torchrun [torchrun options] SCRIPT|-m MODULE [ARGS]``: a torchrun launch, warm.

Many suites launch ``torchrun --nproc-per-node N script.py args`` per test case and judge its
exit status and output. This takes torchrun's command line and runs the script as
``__main__`` on every rank of a warm group of N ranks (:mod:`cpq.rank.script`), then gives
what torchrun would: each rank's output (with ``--tee``, each line prefixed ``[default<r>]:``
as torchrun's agent prefixes it; ``--local-ranks-filter`` keeps only those ranks'), a failure
summary on stderr naming the failing rank and its exit code, and torchrun's exit status (0
when every rank exited 0, else 1).

Only what cpq can make faithful runs warm; anything else runs the real torchrun (``python
-m torch.distributed.run`` with the same arguments), said once on stderr: more than one
node, restarts, ``--no-python``, a rendezvous other than a single-node one, ``--redirects``
to log files, an option this parser does not know, a world size that is not a number, or no
broker. The options are parsed here, not by torch's parser: importing torch would cost the
caller seconds per launch, the very cost cpq removes.

Output comes when the launch ends, not line by line as it happens (docs/design.md, "Warm
torchrun launches").
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cpq import paths

TARGET = "cpq.rank.script:run_script"


class Writer(Protocol):
    def write(self, text: str, /) -> int: ...
    def flush(self) -> None: ...


#: A launch's deadline when ``CPQ_TIMEOUT`` is not set: a launch has none under torchrun;
#: the caller's own time-out (``subprocess.run(timeout=)``) ends it sooner, and its task is
#: cancelled when this process goes.
DEFAULT_TIMEOUT_S = 3600.0

#: torchrun options that take a value, by every spelling torchrun accepts.
_VALUED = {
    "nnodes",
    "nproc-per-node",
    "rdzv-backend",
    "rdzv-endpoint",
    "rdzv-id",
    "rdzv-conf",
    "max-restarts",
    "monitor-interval",
    "start-method",
    "role",
    "log-dir",
    "redirects",
    "r",
    "tee",
    "t",
    "local-ranks-filter",
    "node-rank",
    "master-addr",
    "master-port",
    "local-addr",
    "logs-specs",
    "numa-binding",
    "event-log-handler",
    "signals-to-handle",
    "rdzv-timeout",
}
#: torchrun options without a value.
_FLAGS = {"standalone", "module", "m", "no-python", "run-path", "virtual-local-rank", "use-env"}


@dataclass
class Launch:
    """A torchrun command line, as far as cpq reads it."""

    options: dict[str, str] = field(default_factory=dict)
    flags: set[str] = field(default_factory=set)
    argv: list[str] = field(default_factory=list)  # the script (or module) and its arguments
    unknown: str = ""

    @property
    def module(self) -> bool:
        return bool({"module", "m"} & self.flags)


def parse(args: Sequence[str], environ: Mapping[str, str] | None = None) -> Launch:
    """Split ``args`` into torchrun's options and the script with its arguments; an option
    not given takes torchrun's ``PET_<OPTION>`` variable (of ``environ``, default this
    process's), as torchrun's parser does."""
    environ = os.environ if environ is None else environ
    launch = Launch()
    for name in _VALUED:
        value = environ.get("PET_" + name.upper().replace("-", "_"))
        if value is not None and len(name) > 1:
            launch.options[name] = value
    if environ.get("PET_STANDALONE"):
        launch.flags.add("standalone")
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            launch.argv = list(args[i + 1 :])
            return launch
        if not arg.startswith("-") or arg == "-":
            launch.argv = list(args[i:])
            return launch
        name, eq, value = arg.lstrip("-").partition("=")
        name = name.replace("_", "-")
        if name in _FLAGS and not eq:
            launch.flags.add(name)
            if name in ("module", "m"):  # the module name follows, then its arguments
                launch.argv = list(args[i + 1 :])
                return launch
        elif name in _VALUED:
            if not eq:
                i += 1
                if i >= len(args):
                    launch.unknown = f"{arg} needs a value"
                    return launch
                value = args[i]
            launch.options[name] = value
        else:
            launch.unknown = f"the option {arg}"
            return launch
        i += 1
    return launch


def unfaithful(launch: Launch) -> str:
    """Why this launch cannot run warm ("" when it can)."""
    options = launch.options
    if launch.unknown:
        return f"cpq does not know {launch.unknown}"
    if not launch.argv:
        return "no script to run"
    if options.get("nnodes", "1") not in ("1", "1:1"):
        return f"--nnodes {options['nnodes']} (cpq runs single-node launches)"
    if options.get("max-restarts", "0") != "0":
        return "--max-restarts above 0"
    if "no-python" in launch.flags:
        return "--no-python (a non-Python entry point)"
    if options.get("node-rank", "0") != "0":
        return "--node-rank other than 0"
    backend = options.get("rdzv-backend", "static")
    endpoint = options.get("rdzv-endpoint", "")
    if "standalone" not in launch.flags and (
        backend not in ("static", "c10d")
        or endpoint.split(":")[0] not in ("", "localhost", "127.0.0.1")
    ):
        return f"the rendezvous {backend} {endpoint} (cpq runs single-node ones)"
    redirected = "redirects" in options or "r" in options
    if redirected and not ("tee" in options or "t" in options):
        return "--redirects to log files"
    nproc = options.get("nproc-per-node", "1")
    if not nproc.isdigit() or int(nproc) < 1:
        return f"--nproc-per-node {nproc} (cpq needs a number of ranks)"
    return ""


#: Put first by the start-up hook for ``python -m torch.distributed.launch``: each rank's
#: script gets ``--local-rank=<r>`` before its own arguments, as that launcher passes it.
_LAUNCH_FLAG = "--cpq-launch-local-rank"


@dataclass
class Caller:
    """The process a launch is for: its environment, working directory and output streams.
    This process for ``cpq torchrun``; a shim's for the launch relay
    (:mod:`cpq.client.launch_relay`), which serves launches of processes it did not start."""

    environ: Mapping[str, str]
    cwd: str
    out: Writer
    err: Writer

    @classmethod
    def this_process(cls) -> Caller:
        return cls(os.environ, os.getcwd(), sys.stdout, sys.stderr)


@dataclass
class Plan:
    """A parsed launch and why it cannot run warm ("" when it can)."""

    launch: Launch
    local_rank_arg: bool
    why: str


def plan(args: Sequence[str], environ: Mapping[str, str] | None = None) -> Plan:
    local_rank_arg = _LAUNCH_FLAG in args
    launch = parse([a for a in args if a != _LAUNCH_FLAG], environ)
    if local_rank_arg and "use-env" in launch.flags:
        local_rank_arg = False
    return Plan(launch, local_rank_arg, unfaithful(launch))


def endpoint_of(environ: Mapping[str, str]) -> str:
    return environ.get(paths.ENDPOINT_VAR) or paths.default_endpoint()


#: What ``cpq torchrun --help`` says before torchrun's own help.
HELP = """\
cpq torchrun: torchrun's command line, run on a warm group of this node's cpq broker: the
script runs as __main__ on every rank, with your working directory, environment and
torchrun's worker variables; each rank's output, torchrun's failure summary and exit status
come when the launch ends. What cpq cannot make faithful (several nodes, --max-restarts,
--no-python, another rendezvous, --redirects to files, an option it does not know, no broker)
runs the real torchrun, said once on stderr. torchrun's own options follow.

"""


def main(args: Sequence[str]) -> int:
    """``cpq torchrun ARGS``: the exit status torchrun would give."""
    planned = plan(args)
    if planned.launch.unknown in ("the option --help", "the option -h"):  # before a script
        sys.stdout.write(HELP)
        sys.stdout.flush()
        return real_torchrun(args, "")  # torchrun's help: its options, its exit status
    if planned.why:
        return real_torchrun(args, planned.why)
    from cpq.client.api import BrokerUnavailable, Client
    from cpq.client.autostart import ensure_broker

    endpoint = endpoint_of(os.environ)
    try:
        if endpoint.startswith("ipc://") and os.environ.get("CPQ_AUTOSTART") != "0":
            ensure_broker(endpoint)
        client = Client(endpoint, name="cpq-torchrun")
    except (BrokerUnavailable, OSError, RuntimeError) as exc:
        return real_torchrun(args, f"no broker: {exc}")
    try:  # sent: from here on the script may have run, so never run it again elsewhere
        with client:
            return run_launch(planned, client, Caller.this_process())
    except (BrokerUnavailable, OSError, RuntimeError) as exc:
        sys.stderr.write(f"cpq torchrun: the broker went away during the launch: {exc}\n")
        return 1


def run_launch(
    planned: Plan, client: Any, caller: Caller, on_sent: Callable[[str], None] | None = None
) -> int:
    """Run a launch that can run warm on ``client``'s broker for ``caller``: its output on
    the caller's streams, torchrun's exit status returned. Raises what the client raises
    when the broker goes away (the script may then have run: never run it again)."""
    from cpq.specs import pythonpath_roots

    launch = planned.launch
    kwargs = {
        "argv": launch.argv,
        "module": launch.module,
        "cwd": caller.cwd,
        "run_id": launch.options.get("rdzv-id") or uuid.uuid4().hex,
        "nproc": int(launch.options.get("nproc-per-node", "1")),
        "local_rank_arg": planned.local_rank_arg,
    }
    here = caller.environ is os.environ
    result = client.submit(
        TARGET,
        kwargs["nproc"],
        kwargs,
        timeout=float(caller.environ.get(paths.TIMEOUT_VAR) or DEFAULT_TIMEOUT_S),
        retries=0,  # a launch that dies is the script's verdict, as under torchrun
        test_id="torchrun " + " ".join(launch.argv)[:200],
        environ=None if here else dict(caller.environ),
        # A new worker's sys.path holds the script's folder and PYTHONPATH, never the
        # caller's working directory: the group's roots are PYTHONPATH's entries alone, so
        # launches from any folder share groups (rank/script.py: worker_path).
        roots=pythonpath_roots(caller.cwd, caller.environ),
        on_sent=on_sent,
    )
    report_wait(result.spawn_wait_s, list(result.groups or [result.group_id]), caller.environ)
    _write_output(launch, result, caller)
    return _exit_status(launch, result, caller)


#: The file each launch appends its measured wait for a group to (one JSON line).
WAITS_VAR = "CPQ_LAUNCH_WAITS"


def report_wait(
    wait_s: float | None, groups: list[str], environ: Mapping[str, str] | None = None
) -> None:
    """In ``cpq torchrun``: append this launch's wait and groups for the session that routed
    it (nothing outside a routed pytest test, or from a broker that did not measure it)."""
    environ = os.environ if environ is None else environ
    path, test = environ.get(WAITS_VAR), environ.get("PYTEST_CURRENT_TEST", "")
    if not path or not test or wait_s is None:
        return
    line = json.dumps({"test": test.rsplit(" (", 1)[0], "wait_s": wait_s, "groups": groups})
    try:  # one write of one line, appended: launches of xdist workers do not interleave
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # the test's time then holds the wait, as before


def real_torchrun(args: Sequence[str], why: str) -> int:
    """Run the real torchrun in this process's place, saying why once ("": say nothing)."""
    if why:
        sys.stderr.write(f"cpq torchrun: running the real torchrun: {why}\n")
        sys.stderr.flush()
    module = "torch.distributed.launch" if _LAUNCH_FLAG in args else "torch.distributed.run"
    command = [sys.executable, "-m", module, *[a for a in args if a != _LAUNCH_FLAG]]
    os.environ["CPQ_TORCHRUN_REAL"] = "1"  # cpq's start-up hook lets this one through
    os.execv(sys.executable, command)
    return 127  # not reached


def _shown_ranks(launch: Launch) -> set[int] | None:
    text = launch.options.get("local-ranks-filter", "")
    if not text:
        return None
    return {int(part) for part in text.split(",") if part.strip().isdigit()}


def _write_output(launch: Launch, result: Any, caller: Caller) -> None:
    tee = "tee" in launch.options or "t" in launch.options
    shown = _shown_ranks(launch)
    for rank in sorted(result.ranks, key=lambda r: r.rank):
        if shown is not None and rank.rank not in shown:
            continue
        for out, text in ((caller.out, rank.stdout), (caller.err, rank.stderr)):
            if not text:
                continue
            if tee:
                text = "".join(f"[default{rank.rank}]:{line}" for line in text.splitlines(True))
            out.write(text)
            out.flush()


def _exit_status(launch: Launch, result: Any, caller: Caller) -> int:
    """0 when every rank exited 0; else torchrun's 1, after its ``ChildFailedError`` summary
    (what torchrun's agent prints: each failed rank, the first to fail as the root cause)."""
    codes = {r.rank: r.value for r in result.ranks}
    if (
        result.outcome == "passed"
        and sorted(codes) == list(range(len(codes)))
        and all(code == 0 for code in codes.values())
    ):
        return 0
    script = launch.argv[0] if launch.argv else "?"
    failed = [r for r in sorted(result.ranks, key=lambda r: r.rank) if r.outcome != "passed"]
    _record_failures(failed, caller.environ)
    if not failed:  # no rank's own report: the group failed (a rank died, a deadline)
        lines = ["=" * 60, f"{script} FAILED", "-" * 60, "Failures:"]
        lines.append(f"  {result.message or result.outcome}")
        lines += [f"(cpq: warm group {result.group_id or '?'})", "=" * 60]
        caller.err.write("\n".join(lines) + "\n")
        return 1
    caller.err.write(failure_summary(script, failed) + "\n")
    caller.err.write(f"(cpq: the launch ran on warm group {result.group_id or '?'})\n")
    caller.err.flush()
    return 1


_ERRORS_DOC = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
#: The error type the broker gives a rank still running after a peer failed; torchrun's
#: agent stops such a worker with SIGTERM, and its summary says so.
_STUCK = "cpq.RankStuck"
_SIGTERM = -15


def failure_summary(script: str, failed: list[Any], now: float | None = None) -> str:
    """torchrun's ``ChildFailedError`` line and block for the failed ranks (reports with
    ``rank``, ``value`` (exit code), ``duration_s``, ``error``): the first to fail is the
    root cause, by the time each rank's script ended (``exit code N (pid: P, at T)``)."""
    import datetime
    import re
    import socket
    import time

    now = time.time() if now is None else now
    slowest = max(r.duration_s for r in failed)
    host = socket.getfqdn()
    blocks: dict[int, str] = {}

    def ended(rank: Any) -> float:
        """When the rank's script ended (the rank says; else estimated from durations)."""
        found = re.search(r"at ([0-9.]+)\)", getattr(rank.error, "message", "") or "")
        return float(found.group(1)) if found else now - (slowest - rank.duration_s)

    # In the order the ranks failed (torchrun's agent lists them as it observes them).
    ordered = sorted(failed, key=lambda r: (ended(r), r.rank))
    for idx, rank in enumerate(ordered):
        code = _exit_code(rank)
        found = re.search(r"pid: (\d+)", getattr(rank.error, "message", "") or "")
        pid = found.group(1) if found else "?"
        traceback = _ERRORS_DOC
        if getattr(rank.error, "type", "") == _STUCK:  # stopped by the agent, as torchrun's
            traceback = f"Signal 15 (SIGTERM) received by PID {pid}"
        stamp = int(ended(rank))
        when = datetime.datetime.fromtimestamp(stamp).isoformat(sep="_")
        blocks[rank.rank] = "\n".join(
            [
                f"[{idx}]:",
                f"  time      : {when}",
                f"  host      : {host}",
                f"  rank      : {rank.rank} (local_rank: {rank.rank})",
                f"  exitcode  : {code} (pid: {pid}) ",
                "  error_file: <N/A>",
                f"  traceback : {traceback}",
            ]
        )
    root = ordered[0].rank
    title = f"{script} FAILED"
    lines = [line for text in [title, *blocks.values()] for line in text.split("\n")]
    width = min(60, max(len(line) for line in lines))
    others = [text for r, text in blocks.items() if r != root] or ["  <NO_OTHER_FAILURES>"]
    return "\n".join(
        [
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "=" * width,
            title,
            "-" * width,
            "Failures:",
            *others,
            "-" * width,
            "Root Cause (first observed failure):",
            blocks[root],
            "=" * width,
        ]
    )


#: Set by an in-process ``run`` routed here: where to write each failed rank's exit code,
#: from which it raises torchrun's ``ChildFailedError`` with them.
FAILURES_VAR = "CPQ_TORCHRUN_FAILURES"


def _exit_code(rank: Any) -> int:
    if getattr(rank.error, "type", "") == _STUCK:
        return _SIGTERM
    return rank.value if isinstance(rank.value, int) else 1


def _record_failures(failed: list[Any], environ: Mapping[str, str]) -> None:
    path = environ.get(FAILURES_VAR)
    if not path:
        return
    import json

    codes = {str(r.rank): _exit_code(r) for r in failed}
    try:
        with open(path, "w") as out:
            json.dump(codes, out)
    except OSError:
        pass
