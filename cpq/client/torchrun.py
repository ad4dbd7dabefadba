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

import os
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cpq import paths

TARGET = "cpq.rank.script:run_script"
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


def parse(args: Sequence[str]) -> Launch:
    """Split ``args`` into torchrun's options and the script with its arguments; an option
    not given takes torchrun's ``PET_<OPTION>`` variable, as torchrun's parser does."""
    launch = Launch()
    for name in _VALUED:
        value = os.environ.get("PET_" + name.upper().replace("-", "_"))
        if value is not None and len(name) > 1:
            launch.options[name] = value
    if os.environ.get("PET_STANDALONE"):
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


def main(args: Sequence[str]) -> int:
    """``cpq torchrun ARGS``: the exit status torchrun would give."""
    local_rank_arg = _LAUNCH_FLAG in args
    launch = parse([a for a in args if a != _LAUNCH_FLAG])
    if local_rank_arg and "use-env" in launch.flags:
        local_rank_arg = False
    why = unfaithful(launch)
    if why:
        return real_torchrun(args, why)
    from cpq.client.api import BrokerUnavailable, Client
    from cpq.client.autostart import ensure_broker

    nproc = int(launch.options.get("nproc-per-node", "1"))
    endpoint = os.environ.get(paths.ENDPOINT_VAR) or paths.default_endpoint()
    kwargs = {
        "argv": launch.argv,
        "module": launch.module,
        "cwd": os.getcwd(),
        "run_id": launch.options.get("rdzv-id") or uuid.uuid4().hex,
        "nproc": nproc,
        "local_rank_arg": local_rank_arg,
    }
    timeout = float(os.environ.get(paths.TIMEOUT_VAR) or DEFAULT_TIMEOUT_S)
    try:
        if endpoint.startswith("ipc://") and os.environ.get("CPQ_AUTOSTART") != "0":
            ensure_broker(endpoint)
        client = Client(endpoint, name="cpq-torchrun")
    except (BrokerUnavailable, OSError, RuntimeError) as exc:
        return real_torchrun(args, f"no broker: {exc}")
    try:  # sent: from here on the script may have run, so never run it again elsewhere
        with client:
            result = client.submit(
                TARGET,
                nproc,
                kwargs,
                timeout=timeout,
                retries=0,  # a launch that dies is the script's verdict, as under torchrun
                test_id="torchrun " + " ".join(launch.argv)[:200],
            )
    except (BrokerUnavailable, OSError, RuntimeError) as exc:
        sys.stderr.write(f"cpq torchrun: the broker went away during the launch: {exc}\n")
        return 1
    from cpq.client.launches import report_wait

    report_wait(result.spawn_wait_s, list(result.groups or [result.group_id]))
    _write_output(launch, result)
    return _exit_status(launch, result)


def real_torchrun(args: Sequence[str], why: str) -> int:
    """Run the real torchrun in this process's place, saying why once."""
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


def _write_output(launch: Launch, result: Any) -> None:
    tee = "tee" in launch.options or "t" in launch.options
    shown = _shown_ranks(launch)
    for rank in sorted(result.ranks, key=lambda r: r.rank):
        if shown is not None and rank.rank not in shown:
            continue
        for out, text in ((sys.stdout, rank.stdout), (sys.stderr, rank.stderr)):
            if not text:
                continue
            if tee:
                text = "".join(f"[default{rank.rank}]:{line}" for line in text.splitlines(True))
            out.write(text)
            out.flush()


def _exit_status(launch: Launch, result: Any) -> int:
    """0 when every rank exited 0; else torchrun's 1, with its kind of failure summary."""
    codes = {r.rank: r.value for r in result.ranks}
    if (
        result.outcome == "passed"
        and sorted(codes) == list(range(len(codes)))
        and all(code == 0 for code in codes.values())
    ):
        return 0
    script = launch.argv[0] if launch.argv else "?"
    lines = ["=" * 60, f"{script} FAILED", "-" * 60, "Failures:"]
    failed = [r for r in sorted(result.ranks, key=lambda r: r.rank) if r.outcome != "passed"]
    for rank in failed:
        code = rank.value if isinstance(rank.value, int) else 1
        lines.append(f"  rank {rank.rank} (local_rank: {rank.rank}) exitcode: {code}")
    if not failed:  # no rank's own report: the group failed (a rank died, a deadline)
        lines.append(f"  {result.message or result.outcome}")
    lines.append(f"(cpq: warm group {result.group_id or '?'})")
    lines.append("=" * 60)
    sys.stderr.write("\n".join(lines) + "\n")
    return 1
