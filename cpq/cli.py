"""Command line: ``cpq {broker,status,submit,stop,keys}``, ``cpq-broker``, ``cpq-status``.

``cpq submit`` exit codes (docs/design.md): 0 passed, 1 failed, 2 error, 3 skipped, 4 bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cpq import paths
from cpq.broker.logfile import LogFileHandler
from cpq.fanout.cli import add_merge_arguments, run_merge
from cpq.protocol import PoolSpec
from cpq.timings import TIMINGS_FILE

EXIT_CODES = {"passed": 0, "failed": 1, "error": 2, "skipped": 3}
EXIT_USAGE = 4


# --------------------------------------------------------------------------- broker


def _broker_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--endpoint", help="frontend endpoint (default: CPQ_ENDPOINT or ipc in the state dir)"
    )
    parser.add_argument(
        "--gpus", default="auto", help="auto | none | comma-separated GPU ids (default auto)"
    )
    parser.add_argument(
        "--max-ranks",
        type=int,
        default=max(4, os.cpu_count() or 1),
        help="most CPU (gloo) ranks alive at once (default max(4, cores))",
    )
    parser.add_argument("--oversubscribe", action="store_true", help="let groups share GPUs")
    parser.add_argument(
        "--heartbeat", type=float, default=1.0, help="heartbeat interval in seconds"
    )
    parser.add_argument(
        "--liveness", type=int, default=5, help="missed heartbeats before a peer is dead"
    )
    parser.add_argument(
        "--idle-exit", type=float, default=0.0, help="exit after this many idle seconds (0: never)"
    )
    parser.add_argument(
        "--log-dir", type=Path, help="broker and rank logs (default: <state dir>/logs)"
    )
    parser.add_argument(
        "--timeout", type=float, help="default per-task deadline (default CPQ_TIMEOUT or 90)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=300.0, help="seconds a group may take to start"
    )
    parser.add_argument(
        "--failure-grace",
        type=float,
        default=3.0,
        help="seconds the other ranks get to finish after one rank failed",
    )
    parser.add_argument(
        "--max-tasks-per-group",
        type=int,
        default=0,
        help="recycle a group after N tasks (0: never)",
    )
    parser.add_argument(
        "--scale-up-after",
        type=float,
        default=1.0,
        help="start another group of a busy spec once a task has queued this long (s)",
    )
    parser.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.0,
        metavar="MB",
        help="recycle a group after a task once a rank's RSS grew more than MB since the "
        "group became ready (0: never)",
    )
    parser.add_argument(
        "--timings-file",
        type=Path,
        help="append every finished task here as a JSON line "
        "(default: <state dir>/timings.jsonl; read it with cpq-status --timings)",
    )
    parser.add_argument(
        "--adaptive-timeout",
        action="store_true",
        help="per-test deadlines learned from the timing history: "
        "max(floor, k x the slowest passing run); tests without history keep their timeout",
    )
    parser.add_argument(
        "--adaptive-k", type=float, default=3.0, help="learned deadline factor (default 3)"
    )
    parser.add_argument(
        "--adaptive-floor",
        type=float,
        default=30.0,
        help="shortest learned deadline in seconds (default 30)",
    )
    parser.add_argument(
        "--warm",
        action="append",
        default=[],
        metavar="SPEC=N",
        help="start N groups of SPEC (ws2, ws2:gloo, ws4:nccl) at start-up; repeatable. They "
        "serve clients whose spec matches exactly: same interpreter (this one) and same roots "
        "(--warm-root)",
    )
    parser.add_argument(
        "--warm-root",
        action="append",
        default=[],
        metavar="DIR",
        help="import root of the --warm groups, in order; repeatable (default: the working "
        "directory and PYTHONPATH, which is what `cpq submit` run from here sends; the pytest "
        "plugin sends the rootdir and the test's sys.path entries, see cpq-status --json roots)",
    )
    parser.add_argument(
        "--spares",
        type=int,
        choices=(0, 1),
        default=1,
        help="keep one clean spare group per recently used spec, so a group that must be "
        "replaced (failure, deadline, changed code) is replaced at once (default 1; 0: none)",
    )
    parser.add_argument(
        "--spare-window",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a spec keeps its spare while it ran a task within this many seconds (default 600)",
    )
    parser.add_argument(
        "--insecure", action="store_true", help="allow a tcp endpoint without keys (loopback only)"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


_WARM_SPEC = re.compile(r"ws(?P<ws>[0-9]+)(?::(?P<backend>[a-z]+))?(?:=(?P<count>[0-9]+))?")


def parse_warm(text: str, roots: list[str]) -> tuple[PoolSpec, int]:
    """``--warm ws2:gloo=3`` -> (spec, 3). The spec uses this interpreter and ``roots``."""
    from cpq.client import make_spec

    match = _WARM_SPEC.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--warm {text!r} is not SPEC=N (like ws2=1 or ws2:gloo=2)")
    count = int(match["count"] or 1)
    spec = make_spec(int(match["ws"]), None, roots, match["backend"] or "")
    return spec, count


def _run_broker(args: argparse.Namespace) -> int:
    from cpq.broker.loop import BrokerAlreadyRunning, BrokerConfig, detect_gpus, run_broker
    from cpq.security import InsecureEndpoint

    state = paths.state_dir()
    if args.log_dir:
        log_dir = args.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = paths.ensure_private_dir(state / "logs")
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    try:
        handlers.append(LogFileHandler(str(log_dir / "broker.log")))  # a full disk: warns
    except OSError as exc:
        print(
            f"cpq-broker: cannot write {log_dir / 'broker.log'} ({exc}); logging to stderr only",
            file=sys.stderr,
        )
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=handlers,
    )
    if args.max_ranks < 1:
        print("cpq-broker: --max-ranks must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    from cpq.client import default_roots

    roots = [os.path.abspath(r) for r in args.warm_root] or default_roots()
    try:
        warm = [parse_warm(text, roots) for text in args.warm]
    except ValueError as exc:
        print(f"cpq-broker: {exc}", file=sys.stderr)
        return EXIT_USAGE
    config = BrokerConfig(
        endpoint=args.endpoint or paths.default_endpoint(),
        state_dir=state,
        log_dir=log_dir,
        gpus=detect_gpus(args.gpus),
        max_ranks=args.max_ranks,
        oversubscribe=args.oversubscribe,
        heartbeat_s=args.heartbeat,
        liveness=args.liveness,
        idle_exit_s=args.idle_exit,
        start_timeout_s=args.start_timeout,
        failure_grace_s=args.failure_grace,
        max_tasks_per_group=args.max_tasks_per_group,
        default_timeout_s=args.timeout or paths.default_timeout(),
        insecure=args.insecure,
        scale_up_after_s=args.scale_up_after,
        timings_file=args.timings_file or state / TIMINGS_FILE,
        adaptive_timeout=args.adaptive_timeout,
        adaptive_k=args.adaptive_k,
        adaptive_floor_s=args.adaptive_floor,
        max_rss_growth_mb=args.max_rss_growth,
        spares=args.spares,
        spare_window_s=args.spare_window,
        warm=warm,
    )
    try:
        run_broker(config)
    except (BrokerAlreadyRunning, InsecureEndpoint) as exc:
        print(f"cpq-broker: {exc}", file=sys.stderr)
        return 1
    return 0


def broker_main(argv: Sequence[str] | None = None) -> int:
    parser = _broker_parser(
        argparse.ArgumentParser(prog="cpq-broker", description="Run a cpq broker.")
    )
    return _safely(_run_broker, parser.parse_args(argv), "cpq-broker")


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
    return parser


def _run_timings(args: argparse.Namespace) -> int:
    from cpq import timings
    from cpq.render import render_timings

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
    from cpq.autostart import broker_alive
    from cpq.client import BrokerUnavailable, Client
    from cpq.render import render, render_prometheus, render_prometheus_down

    if args.timings:
        return _run_timings(args)
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
    return _safely(_run_status, parser.parse_args(argv), "cpq-status")


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
    from cpq.autostart import ensure_broker
    from cpq.client import BadRequest, BrokerUnavailable, Client
    from cpq.protocol import EncodeError
    from cpq.render import render_result

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
    from cpq.autostart import broker_alive

    return endpoint.startswith("ipc://") and not broker_alive(endpoint)


def _run_stop(args: argparse.Namespace) -> int:
    from cpq.client import BrokerUnavailable, Client

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
    print("drain requested" if args.drain else "broker stopped")
    return 0


def _run_drain(args: argparse.Namespace) -> int:
    """``cpq drain``: accepted tasks finish, new submits are refused, then the broker stops."""
    from cpq.autostart import broker_alive
    from cpq.client import BrokerUnavailable, Client

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
    parser = argparse.ArgumentParser(
        prog="cpq", description="Warm torchrun groups for test suites."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _broker_parser(commands.add_parser("broker", help="run a broker")).set_defaults(run=_run_broker)
    _status_parser(commands.add_parser("status", help="show a broker's state")).set_defaults(
        run=_run_status
    )
    _submit_parser(
        commands.add_parser("submit", help="run module:function on a warm group")
    ).set_defaults(run=_run_submit)
    stop = commands.add_parser("stop", help="stop the broker")
    stop.add_argument("--endpoint")
    stop.add_argument("--drain", action="store_true", help="finish running tasks first")
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
        "merge", help="check and combine CI fan-out shard results (exit 0/1/2, 4 bad input)"
    )
    add_merge_arguments(merge)
    merge.set_defaults(run=run_merge)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    return _safely(args.run, args, f"cpq {args.command}")


def _safely(run: Any, args: argparse.Namespace, prog: str) -> int:
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
