"""Command line: ``cpq {broker,status,submit,stop,keys}``, ``cpq-broker``, ``cpq-status``.

``cpq submit`` exit codes (docs/design.md): 0 passed, 1 failed, 2 error, 3 skipped, 4 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cpq import osutil, paths
from cpq.timings import TIMINGS_FILE

EXIT_CODES = {"passed": 0, "failed": 1, "error": 2, "skipped": 3}
EXIT_USAGE = 4


# --------------------------------------------------------------------------- status


def _status_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--endpoint")
    view = parser.add_mutually_exclusive_group()
    view.add_argument("--json", action="store_true", help="print one JSON object")
    view.add_argument(
        "--prometheus", action="store_true", help="print Prometheus' text exposition format"
    )
    parser.add_argument("--watch", type=float, nargs="?", const=1.0, help="refresh every N seconds")
    parser.add_argument(
        "--timings",
        action="store_true",
        help="summarise the timing history (p50/p95/max per test, slowest runs); "
        "reads the file, needs no broker",
    )
    parser.add_argument(
        "--file", type=Path, help="timing history to read (default <state dir>/timings.jsonl)"
    )
    parser.add_argument(
        "--top", type=int, default=10, help="--timings: how many slowest runs to list"
    )
    from cpq.timeline import command as timeline

    timeline.add_output_arguments(parser)
    timeline.add_window_arguments(parser)
    return parser


def _run_timings(args: argparse.Namespace) -> int:
    from cpq import timings
    from cpq.client.render import render_timings

    path = args.file or paths.state_dir() / TIMINGS_FILE
    summary = timings.summarize(timings.read(path), top=args.top)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(render_timings(summary, path))
    return 0


def _watch_frame(text: str, first: bool) -> str:
    """Redraw in place: home the cursor, overwrite each line, clear what is left below.

    Clearing the whole screen every refresh makes the table flicker; overwriting does not.
    """
    body = "\n".join(line + "\x1b[K" for line in text.split("\n"))
    return ("\x1b[2J" if first else "") + "\x1b[H" + body + "\n\x1b[J"


def _run_status(args: argparse.Namespace) -> int:
    from cpq.client.api import BrokerUnavailable, Client
    from cpq.client.autostart import broker_alive
    from cpq.client.render import render, render_prometheus, render_prometheus_down

    if args.timings:
        return _run_timings(args)
    if args.trace or args.timeline:
        from cpq.timeline.command import status_pictures

        return status_pictures(args, args.file or paths.state_dir() / TIMINGS_FILE)
    endpoint = args.endpoint or paths.default_endpoint()
    in_place = bool(args.watch) and not (args.json or args.prometheus) and sys.stdout.isatty()
    first = True
    try:
        if endpoint.startswith("ipc://") and not broker_alive(endpoint):
            # No process holds the endpoint's lock: say so now, not after a connect time-out.
            raise BrokerUnavailable(f"no cpq broker runs at {endpoint}")
        with Client(endpoint, name="cpq-status", connect_timeout_s=5) as client:
            while True:
                status = client.status()
                if args.json:  # with --watch: one JSON object per line, per refresh
                    print(json.dumps(status, indent=None, sort_keys=True), flush=True)
                elif args.prometheus:
                    print(render_prometheus(status), end="", flush=True)
                elif in_place:
                    print(_watch_frame(render(status), first), end="", flush=True)
                else:
                    print(render(status) + ("\n" if args.watch else ""), flush=True)
                first = False
                if not args.watch:
                    return 0
                time.sleep(args.watch)
    except BrokerUnavailable as exc:
        if args.prometheus:  # a scrape of a dead broker is data: cpq_up 0
            print(render_prometheus_down(), end="", flush=True)
        if args.json:  # scripts parse stdout: a missing broker is a document too
            down: dict[str, Any] = {
                "broker": None,
                "error": str(exc),
                "pools": [],
                "queue": [],
                "clients": [],
            }
            print(json.dumps({**down, "totals": {}}, sort_keys=True), flush=True)
        print(f"cpq-status: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def status_main(argv: Sequence[str] | None = None) -> int:
    parser = _status_parser(
        argparse.ArgumentParser(prog="cpq-status", description="Show a broker's state.")
    )
    argv = joined_times(sys.argv[1:] if argv is None else argv)
    return safely(_run_status, parser.parse_args(argv), "cpq-status")


def joined_times(argv: Sequence[str]) -> list[str]:
    """``--since -4m`` read as ``--since=-4m`` (README's form): argparse takes a value that
    starts with ``-`` and is not a plain number for an option (``expected one argument``)."""
    out: list[str] = []
    for token in argv:
        if out and out[-1] in ("--since", "--until") and re.match(r"-\d", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


# --------------------------------------------------------------------------- submit


def parse_value(text: str) -> Any:
    """``key=value`` values: JSON where they parse (3, true, [1,2]), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _submit_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("target", help="package.module:function")
    parser.add_argument("kwargs", nargs="*", metavar="key=value")
    parser.add_argument("--world-size", "-n", type=int, required=True)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--env", action="append", default=[], metavar="K=V")
    parser.add_argument("--endpoint")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.add_argument("--no-autostart", action="store_true", help="never start a broker")
    return parser


def _run_submit(args: argparse.Namespace) -> int:
    from cpq.client.api import BrokerUnavailable, Client
    from cpq.client.autostart import ensure_broker
    from cpq.client.render import render_result
    from cpq.protocol import EncodeError
    from cpq.specs import BadRequest

    kwargs: dict[str, Any] = {}
    for item in args.kwargs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"cpq submit: argument {item!r} is not key=value", file=sys.stderr)
            return EXIT_USAGE
        kwargs[key] = parse_value(value)
    env: dict[str, str] = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"cpq submit: --env {item!r} is not K=V", file=sys.stderr)
            return EXIT_USAGE
        env[key] = value
    endpoint = args.endpoint or paths.default_endpoint()
    try:
        if not args.no_autostart and endpoint.startswith("ipc://"):
            ensure_broker(endpoint)
        with Client(endpoint, name="cpq-submit") as client:
            result = client.submit(
                args.target,
                args.world_size,
                kwargs,
                timeout=args.timeout,
                env=env,
                on_wait=lambda notice: print(f"cpq submit: {notice}", file=sys.stderr),
            )
    except (BadRequest, EncodeError) as exc:
        print(f"cpq submit: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (BrokerUnavailable, RuntimeError) as exc:
        print(f"cpq submit: {exc}", file=sys.stderr)
        return EXIT_CODES["error"]
    if args.json:
        from dataclasses import asdict

        print(json.dumps({**asdict(result), "value": result.value}, default=repr))
    else:
        print(render_result(result))
    return EXIT_CODES.get(result.outcome, EXIT_CODES["error"])


# --------------------------------------------------------------------------- stop, keys


def _no_broker(endpoint: str) -> bool:
    """Nothing holds an ipc endpoint's lock: no broker, known at once (no connect time-out)."""
    from cpq.client.autostart import broker_alive

    return endpoint.startswith("ipc://") and not broker_alive(endpoint)


def _run_stop(args: argparse.Namespace) -> int:
    from cpq.caller import wire
    from cpq.client.api import BrokerUnavailable, Client

    callers = wire.retire_all()  # the warm callers of this state directory, with the broker
    if callers:
        print(f"cpq stop: {callers} warm caller(s) take no more sessions and exit")
    endpoint = args.endpoint or paths.default_endpoint()
    if _no_broker(endpoint):
        print(f"cpq stop: no cpq broker runs at {endpoint}; nothing to stop")
        return 0
    try:
        with Client(endpoint, name="cpq-stop", connect_timeout_s=5) as c:
            c.stop(drain=args.drain)
    except BrokerUnavailable as exc:
        print(f"cpq stop: {exc}", file=sys.stderr)
        return 2
    if args.drain:
        print("drain requested")
        return 0
    if not endpoint.startswith("ipc://"):  # a broker elsewhere: its exit cannot be seen here
        print("stop requested")
        return 0
    # "stopped" when it is: its groups stop first (a grace each), and a script that starts
    # a broker next must not find this one still holding the endpoint.
    deadline = time.monotonic() + args.timeout
    while not _no_broker(endpoint):
        if time.monotonic() > deadline:
            print(f"cpq stop: the broker still runs after {args.timeout:g}s", file=sys.stderr)
            return 2
        time.sleep(0.05)
    print("broker stopped")
    return 0


def _run_drain(args: argparse.Namespace) -> int:
    """``cpq drain``: accepted tasks finish, new submits are refused, then the broker stops."""
    from cpq.client.api import BrokerUnavailable, Client
    from cpq.client.autostart import broker_alive

    endpoint = args.endpoint or paths.default_endpoint()
    if _no_broker(endpoint):
        print(f"cpq drain: no cpq broker runs at {endpoint}; nothing to drain")
        return 0
    try:
        with Client(endpoint, name="cpq-drain", connect_timeout_s=5) as client:
            status = client.stop(drain=True)
    except BrokerUnavailable as exc:
        print(f"cpq drain: {exc}", file=sys.stderr)
        return 2
    running = sum(1 for p in status["pools"] if p.get("task"))
    queued = sum(q["depth"] for q in status["queue"])
    print(
        f"draining: {running} running and {queued} queued task(s) will finish; new submits "
        "are refused; the broker stops after them",
        flush=True,
    )
    if not args.wait:
        return 0
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while broker_alive(endpoint):
        if deadline is not None and time.monotonic() > deadline:
            print(f"cpq drain: the broker still runs after {args.timeout:g}s", file=sys.stderr)
            return 2
        time.sleep(0.1)
    print("broker stopped")
    return 0


def _run_keys(args: argparse.Namespace) -> int:
    from cpq.security import KeysExist, generate_keys

    try:
        base = generate_keys(args.dir, replace=args.force)
    except KeysExist as error:  # kept, as asked: not a failure
        print(f"cpq keys: {error}; kept them (--force replaces them)", file=sys.stderr)
        return 0
    print(f"keys written to {base} (authorised clients: {base / 'authorized'})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["broker"]:
        # `cpq broker` becomes the broker process itself (same pid): the broker's command line
        # lives in its own folder, which no client module imports (docs/design.md)
        os.execv(sys.executable, osutil.broker_command(*argv[1:]))
    if argv[:1] == ["torchrun"]:  # torchrun's own command line follows, not ours
        from cpq.client import torchrun

        return torchrun.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="cpq", description="Warm torchrun groups for test suites."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    # listed for --help; `cpq broker ...` is handed whole to the broker's own command line
    commands.add_parser("broker", help="run a broker (cpq-broker)", add_help=False)
    commands.add_parser(
        "torchrun",
        help="run a torchrun launch on a warm group (torchrun's options)",
        add_help=False,
    )
    _status_parser(commands.add_parser("status", help="show a broker's state")).set_defaults(
        run=_run_status
    )
    _submit_parser(
        commands.add_parser("submit", help="run module:function on a warm group")
    ).set_defaults(run=_run_submit)
    stop = commands.add_parser("stop", help="stop the broker (and the warm callers)")
    stop.add_argument("--endpoint")
    stop.add_argument("--drain", action="store_true", help="finish running tasks first")
    stop.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the broker to exit (default 60; an ipc endpoint's only)",
    )
    stop.set_defaults(run=_run_stop)
    drain = commands.add_parser(
        "drain", help="finish running and queued tasks, refuse new ones, then stop the broker"
    )
    drain.add_argument("--endpoint")
    drain.add_argument("--wait", action="store_true", help="return once the broker has stopped")
    drain.add_argument("--timeout", type=float, help="--wait at most this many seconds")
    drain.set_defaults(run=_run_drain)
    keys = commands.add_parser("keys", help="create CURVE keys for tcp endpoints")
    keys.add_argument("--dir", type=Path)
    keys.add_argument("--force", action="store_true", help="replace keys that already exist")
    keys.set_defaults(run=_run_keys)
    merge = commands.add_parser(
        "merge",
        help="check and combine CI fan-out shard results (exit 0/1/2, 3 internal, 4 bad input)",
    )
    from cpq.fanout.cli import add_merge_arguments, guarded  # a launch never pays for it

    add_merge_arguments(merge)
    merge.set_defaults(run=guarded)
    try:
        args = parser.parse_args(joined_times(argv))
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    return safely(args.run, args, f"cpq {args.command}")


def safely(run: Any, args: argparse.Namespace, prog: str) -> int:
    """Run a command; an unsafe state directory is a one-line error, not a traceback."""
    try:
        return int(run(args))
    except paths.UnsafeStateDir as exc:
        print(f"{prog}: refusing to run: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `cpq-status | head`: the reader left, as readers may
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
