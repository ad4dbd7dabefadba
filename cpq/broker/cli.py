"""``cpq-broker`` (also ``cpq broker`` and ``python -m cpq.broker``): the broker's command line.

Parses the options into a :class:`~cpq.broker.config.BrokerConfig`, sets up logging and runs
the event loop. Lives in the broker's folder so that starting a broker loads no client code
(docs/design.md "Module map"); ``--warm`` specs are built by the shared leaf
:mod:`cpq.specs`, as the client builds its tasks' specs.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from cpq import osutil, paths, spin
from cpq.broker.logfile import LogFileHandler
from cpq.protocol import PoolSpec
from cpq.specs import default_roots, make_spec
from cpq.timings import TIMINGS_FILE

EXIT_USAGE = 4


def _broker_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--endpoint", help="frontend endpoint (default: CPQ_ENDPOINT or ipc in the state dir)"
    )
    parser.add_argument(
        "--gpus",
        default="auto",
        help="auto | none | comma-separated GPU ids | fake:N (a test inventory of N GPUs "
        "GPU-fake-<i> whose ranks run gloo) (default auto)",
    )
    parser.add_argument(
        "--gpu-leases",
        type=Path,
        metavar="DIR",
        help="node-shared GPU lease directory: brokers of every user and container that "
        "share it never share a GPU (default CPQ_GPU_LEASES, else /run/lock/cpq-gpus, "
        "else /tmp/cpq-gpus)",
    )
    parser.add_argument(
        "--max-ranks",
        type=int,
        default=max(4, os.cpu_count() or 1),
        help="most CPU (gloo) ranks running tasks at once; idle ones count against --memory "
        "(default max(4, cores))",
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
        "--idle-release",
        type=float,
        default=900.0,
        metavar="S",
        help="stop an idle group beyond its spec's most recently used one after S seconds "
        "unused (default 900; 0: never)",
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
        "--memory",
        "--spare-memory",  # its name before every idle CPU group counted memory (0.1)
        dest="memory",
        type=float,
        metavar="MB",
        help="memory CPU groups may hold while they live: an idle rank costs memory, a busy "
        "one a core (--max-ranks); each group counts its measured RSS; full, a start stops "
        "the least recently used idle groups (default: half the memory available when the "
        "broker starts)",
    )
    parser.add_argument(
        "--insecure", action="store_true", help="allow a tcp endpoint without keys (loopback only)"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


_WARM_SPEC = re.compile(r"ws(?P<ws>[0-9]+)(?::(?P<backend>[a-z]+))?(?:=(?P<count>[0-9]+))?")


def parse_warm(text: str, roots: list[str]) -> tuple[PoolSpec, int]:
    """``--warm ws2:gloo=3`` -> (spec, 3). The spec uses this interpreter and ``roots``."""
    match = _WARM_SPEC.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--warm {text!r} is not SPEC=N (like ws2=1 or ws2:gloo=2)")
    count = int(match["count"] or 1)
    spec = make_spec(int(match["ws"]), None, roots, match["backend"] or "")
    return spec, count


def _run_broker(args: argparse.Namespace) -> int:
    from cpq.broker.loop import BrokerAlreadyRunning, BrokerConfig, run_broker
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
    try:
        spin.default_window_s()  # a bad CPQ_SPIN_US: said here, before any socket
    except ValueError as exc:
        print(f"cpq-broker: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.max_ranks < 1:
        print("cpq-broker: --max-ranks must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if args.memory is not None and args.memory < 0:
        print("cpq-broker: --memory must be 0 or more (MB)", file=sys.stderr)
        return EXIT_USAGE
    memory_mb = args.memory
    if memory_mb is None:
        memory_mb = osutil.available_memory_mb() / 2
    from cpq.broker import inventory, leasedir

    try:
        gpus = inventory.detect(args.gpus)
    except ValueError as exc:
        print(f"cpq-broker: {exc}", file=sys.stderr)
        return EXIT_USAGE
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
        gpus=gpus.gpus,
        gpu_uuids=gpus.uuids,
        fake_gpus=gpus.fake,
        gpu_leases=args.gpu_leases or leasedir.default_dir(),
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
        idle_release_s=args.idle_release,
        spares=args.spares,
        spare_window_s=args.spare_window,
        memory_mb=memory_mb,
        warm=warm,
    )
    try:
        run_broker(config)
    except (BrokerAlreadyRunning, InsecureEndpoint) as exc:
        print(f"cpq-broker: {exc}", file=sys.stderr)
        return 1
    return 0


def broker_main(argv: Sequence[str] | None = None, prog: str = "cpq-broker") -> int:
    parser = _broker_parser(argparse.ArgumentParser(prog=prog, description="Run a cpq broker."))
    args = parser.parse_args(argv)
    try:
        return _run_broker(args)
    except paths.UnsafeStateDir as exc:
        print(f"{prog}: refusing to run: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(broker_main())
