"""The rank runtime: what every rank of a warm group runs (``torchrun ... -m cpq.rank``).

Two threads per rank share one ZeroMQ DEALER (:mod:`cpq.rank.io`). The main thread, here,
initialises the process group once and then loops: wait for a task on the socket, reset
state, import and call the target with fd-level capture, report on the socket. The watchdog
thread holds the socket while the main thread is busy (start-up, long tasks).

Only :mod:`cpq.protocol` is shared with the broker; everything here is configured through
``CPQ_*`` variables the group supervisor sets.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import zmq

from cpq import protocol, tracepoints
from cpq.osutil import die_with_parent
from cpq.rank import (
    ahead,
    boundary,
    cancel,
    carryover,
    exits,
    failure_report,
    importenv,
    items,
    leases,
    pdb_relay,
    pgroups,
    reset,
    script,
)
from cpq.rank.capture import FdCapture
from cpq.rank.coverage_task import measured
from cpq.rank.freshness import CodeWatch
from cpq.rank.io import CPQ_DIR, Link, RankConfig, Watchdog, hard_exit
from cpq.rank.profiling import TaskProfile
from cpq.rank.reset import Baseline, load_hooks_from_env, reset_state

log = logging.getLogger("cpq.rank")


# --------------------------------------------------------------------------- main thread


def redirect_output_to_log(config: RankConfig) -> None:
    """Point fds 1 and 2 at this rank's log file (what it prints between tasks lands there)."""
    if not config.log_dir:
        return
    path = Path(config.log_dir) / f"group-{config.group_id}-rank{config.rank}.log"
    with contextlib.suppress(OSError):  # a full or missing log dir must not stop the rank
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def _log_to_stderr(rank: int) -> None:
    """cpq's own records go to the rank's log (its stderr); the root logger stays as a fresh
    process has it (WARNING, no handler), so a test's logging behaves as in a fresh run."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    )
    own = logging.getLogger("cpq")
    own.addHandler(handler)
    own.setLevel(logging.INFO)
    own.propagate = False


def init_process_group(config: RankConfig) -> None:
    import torch
    import torch.distributed as dist

    if config.dist_backend == "nccl":
        torch.cuda.set_device(config.local_rank)
        # No ``device_id``: a default group bound to a device makes every ``new_group``
        # build its communicator at once, where the code's own ``init_process_group``
        # without one builds it on first use (Megatron builds dozens of groups per test
        # and uses few: eager, they ran the GPU out of memory). The code binds a device
        # itself when it asks for one (cpq.rank.pgroups). docs/design.md, "The process
        # group the code sees".
        dist.init_process_group("nccl")
        probe = torch.ones(1, device="cuda")
    else:
        dist.init_process_group(config.dist_backend)
        probe = torch.ones(1)
    # One collective now creates the communicators, so the first task does not pay for it.
    dist.all_reduce(probe)
    if int(probe.item()) != config.world_size:
        raise RuntimeError(f"startup all_reduce gave {probe.item()}, expected {config.world_size}")


def preload_modules() -> None:
    """Import ``CPQ_PRELOAD`` modules (comma separated) before the state baseline is taken.

    Heavy imports (``transformer_engine.pytorch`` costs 5-9 s) then happen at group start,
    not in the first test, and whatever they put in ``os.environ`` at import time (TE sets
    ``NVTE_CUDA_INCLUDE_DIR``) becomes part of the baseline instead of being reset away.
    A failing preload is logged, not fatal: the tasks that need the module will report it.
    """
    for name in filter(None, (m.strip() for m in os.environ.get("CPQ_PRELOAD", "").split(","))):
        started = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception:
            log.exception("preloading %s failed", name)
        else:
            log.info("preloaded %s in %.2fs", name, time.monotonic() - started)


def resolve_target(target: str) -> Any:
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"target {target!r} must look like 'package.module:function'")
    # An edited target module is not reloaded in place (not provably safe): the code
    # check before the task sends the task to a fresh group instead (cpq.rank.freshness).
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"target {target!r} is not callable")
    return obj


def _is_skip(exc: BaseException) -> bool:
    import unittest

    if isinstance(exc, unittest.SkipTest):
        return True
    outcomes = sys.modules.get("_pytest.outcomes")
    return outcomes is not None and isinstance(exc, outcomes.Skipped)


def _rss_mb() -> float:
    """This process's resident memory now; one ``pread`` of a descriptor kept open."""
    global _STATM_FD
    try:
        if _STATM_FD < 0:
            _STATM_FD = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        pages = int(os.pread(_STATM_FD, 128, 0).split()[1])
        return pages * _PAGE_BYTES / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


_STATM_FD = -1
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _cuda_now_mb() -> tuple[float, float]:
    """``(allocated, reserved)`` MB on this rank's device right now; zeros without CUDA.

    Reported after every task so ``cpq-status`` shows what a warm rank keeps holding
    between tasks (a leak there is what makes the next test run out of memory).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0.0, 0.0
    return torch.cuda.memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20


#: A rank with fewer free file descriptors than this after a task is recycled.
FD_HEADROOM = 32


def _unfit_reason() -> str:
    """Why this rank must not serve another task ("" when it may).

    A task that leaves the process without free file descriptors (leaked sockets, files,
    an exhausted ``RLIMIT_NOFILE``) would make every later test on this rank fail in ways
    that have nothing to do with it (an ``import`` or an ``open`` fails); the broker
    recycles the group instead. Costs one directory listing (~15 us) per task.
    """
    if script.leftover:  # a launched script left threads behind: not a fresh worker any more
        why, script.leftover = script.leftover, ""
        return why
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError as exc:  # EMFILE: not even one descriptor is left for the listing
        return f"cannot open file descriptors any more ({exc.strerror})"
    if soft != resource.RLIM_INFINITY and soft - used < FD_HEADROOM:
        return f"has {used} file descriptors open of its limit of {soft}"
    return ""


def _peak_cuda_mb() -> float:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0.0
    return float(torch.cuda.max_memory_allocated()) / 2**20


@dataclass
class Ran:
    """What :func:`run_task` gives back besides the result."""

    #: A variable an import bound to another value than the task's: nothing ran
    #: (:mod:`cpq.rank.importenv`); ``at_start``: it was bound during start-up.
    variable: str = ""
    at_start: bool = False
    coverage: list[bytes] = field(default_factory=list)


def run_task(
    task: protocol.RunTask,
    rank: int,
    baseline: Baseline,
    capture: FdCapture,
    check_env: bool = True,
) -> tuple[protocol.RankResult, Ran]:
    ran = Ran()
    outcome: protocol.Outcome = "passed"
    error, value, report = None, None, ""
    reports: list[dict[str, Any]] = []
    warnings: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        is_item = items.is_item_task(task.target)
        if not is_item:
            items.step_aside()
        reset_state(baseline, task.seed, task.env, task.rng, generators=not is_item)
        if check_env:
            ran.variable, ran.at_start = importenv.differs()
            if ran.variable:
                return protocol.RankResult(rank=rank, outcome="error"), ran
        with capture:
            try:
                function = resolve_target(task.target)
                with cancel.window(task.task_id), measured(task.coverage, ran.coverage):
                    value = function(**task.kwargs)
                if isinstance(value, items.ItemRun):  # a test run by pytest in this rank
                    outcome, error = _item_outcome(value)
                    reports, warnings = value.reports, value.warnings
                    if task.debug and outcome == "failed" and value.failure is not None:
                        pdb_relay.keep(value.failure)  # its frames, for pytest --pdb
                    value = value.value
                else:
                    _check_return_value(task.target, value)
            except BaseException as exc:  # the task's failure is data, not our crash
                outcome = "skipped" if _is_skip(exc) else "failed"
                error = _describe(exc)
                if outcome == "failed":
                    report = failure_report.render(exc, _user_tb(exc))
                value = None
                if task.debug and outcome == "failed":
                    pdb_relay.keep(exc)  # its frames, for a post-mortem (pytest --pdb)
    except BaseException as exc:  # reset or capture itself broke: still report it
        outcome, error, value = "failed", _describe(exc), None
    result = protocol.RankResult(
        rank=rank,
        outcome=outcome,
        error=error,
        stdout=capture.stdout,
        stderr=capture.stderr,
        duration_s=time.perf_counter() - start,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        peak_cuda_mb=_peak_cuda_mb(),
        value=value,
        report=report,
        reports=reports,
        warnings=warnings,
    )
    return result, ran


def _item_outcome(run: items.ItemRun) -> tuple[protocol.Outcome, protocol.RankError | None]:
    """What the broker's outcome table reads of a test pytest ran here (its setup or
    teardown error is a failure: the broker's ``error`` means infra and is retried)."""
    outcome: protocol.Outcome = "failed"
    if run.outcome in ("passed", "skipped"):
        outcome = "passed" if run.outcome == "passed" else "skipped"
    error = None if run.error is None else protocol.RankError(*run.error)
    return outcome, error


def _check_return_value(target: str, value: Any) -> None:
    """Refuse a return value that cannot travel here, saying so in the user's terms."""
    problem = protocol.travel_problem(value)
    if problem:
        raise protocol.EncodeError(
            f"the return value of {target} (a {type(value).__name__}) cannot be sent back: "
            f"{problem}. Return msgpack-able values (None, bool, int, float, str, "
            "bytes, lists and dicts of them with string keys), e.g. tensor.tolist() instead "
            "of a tensor."
        )


def _describe(exc: BaseException) -> protocol.RankError:
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    message = getattr(exc, "msg", None) if _is_skip(exc) else None
    tb = _user_tb(exc)  # hide cpq's own frames: the user's traceback starts at their code
    return protocol.RankError(
        type=name,
        message=str(message if message is not None else exc),
        traceback="".join(traceback.format_exception(kind, exc, tb)),
    )


def _user_tb(exc: BaseException) -> TracebackType | None:
    """``exc``'s traceback from the user's first frame on (cpq's own frames cut)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(CPQ_DIR):
        tb = tb.tb_next
    return tb


def _began_sender(
    link: Link, task_id: str, rank: int, features: frozenset[str]
) -> Callable[[], None] | None:
    """What tells the broker that a test's own protocol begins (None: a broker that cannot
    read it). The main thread takes the socket back from the watchdog for the one frame."""
    if "rank-pytest" not in features:
        return None
    frame = protocol.encode(protocol.RankBegun(task_id=task_id, rank=rank))

    def send() -> None:
        link.take()
        try:
            link.send(frame)
        finally:
            link.give()

    return send


#: How many heartbeats apart an idle rank looks at its code (5 s at the default 1 s).
IDLE_CHECKS = 5


def _idle_code_check(link: Link, watch: CodeWatch, config: RankConfig) -> Callable[[], None]:
    """What the idle main thread runs between polls: every ``IDLE_CHECKS`` heartbeats, when
    no calling session is open here, whether a file this rank loaded changed; the first
    change found is told to the broker once (``RankStale``), which stops the idle group.

    Why: a group for code that changed would refuse its next task anyway (the check at a
    task's start); until then it holds its memory (and GPUs) for code nobody runs. Not
    inside a session: a fresh pytest process keeps the code its first test saw, and so
    does the session's group until its caller's last test. Cost: a ``stat`` per watched
    file every few seconds, while idle."""
    every = config.heartbeat_s * IDLE_CHECKS
    state = {"next": time.monotonic() + every, "said": False}

    def check() -> None:
        now = time.monotonic()
        if state["said"] or now < float(state["next"]) or items.in_session():
            return
        state["next"] = now + every
        path = watch.changed()
        if path:
            log.info("idle, and %s changed since this group loaded it", path)
            link.send(protocol.encode(protocol.RankStale(rank=config.rank, path=path)))
            state["said"] = True

    return check


def _pg_sequence() -> int:
    """The default process group's collective count so far (-1 where torch cannot say)."""
    try:
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
        return int(getattr(group, "_get_sequence_number_for_group")())  # noqa: B009
    except Exception:
        return -1


def _cross_boundary(task: protocol.RunTask, carried: carryover.Carryover) -> str:
    """Before a task that does not go on with the session whose tests ran here: that
    session ends if the task is another caller's; torch's switches go back to the ready
    rank's. Returns why this rank may not serve the task ("": it may)."""
    ended = items.ends_current(task)
    if ended:
        items.close_current()
    if ended or task.target == script.TARGET:  # a launch is a new process
        _forget_modules("launch" if task.target == script.TARGET else "session")
    if ended:
        why = carried.unfit_after_caller()
        if why:
            log.info("not serving another caller: this rank %s", why)
            return f"the last caller left this rank unfit: it {why}"
    if not items.of_current(task):  # opened here: what its conftests set is the session's
        carried.restore_switches()
    return ""


def _after_caller(
    task: protocol.RunTask,
    result: protocol.RankResult,
    carried: carryover.Carryover,
    baseline: Baseline,
) -> str:
    """Why this rank must serve nothing more after ``task`` ("": it may): what a session
    that just ended here, or a launch, left that a new process would not have; a sticky
    CUDA error after a failure (at once, after the failing test's own report). A rank fit
    to serve on plans to import what the session imported ahead of the next
    (:mod:`cpq.rank.ahead`)."""
    ended = items.session_ended or task.target == script.TARGET
    items.session_ended = False
    if ended:  # what it imported goes first: the memory check then sees it gone too
        launch = task.target == script.TARGET
        path, cwd = list(script.last_path if launch else sys.path), os.getcwd()
        crossed = _forget_modules("launch" if launch else "session")
        ahead.drop("not imported by the session that just ended")  # before the memory check
        unfit = carried.unfit_after_caller()
        if not unfit and crossed is not None:
            ahead.learn(crossed, path, cwd, reset.environ_for(baseline, task.env))
        return unfit
    if result.outcome == "failed":
        return carryover.sticky_cuda_error()
    return ""


def _forget_modules(why: str) -> boundary.Crossed | None:
    """The modules the caller imported go (:mod:`cpq.rank.boundary`): the next session or
    launch imports them afresh, as a new process would."""
    try:
        return boundary.cross(why)
    except Exception:  # a boundary that cannot be crossed must not take the rank down
        log.exception("crossing the %s boundary failed", why)
        return None


def main() -> None:
    started_ns = time.time_ns()
    watch = CodeWatch(cpq=False)  # the site directories as they are at start-up
    config = RankConfig.from_env()
    die_with_parent()
    leases.check_held()  # before any GPU is touched
    redirect_output_to_log(config)
    _log_to_stderr(config.rank)
    started = time.monotonic()
    # Import torch before the watchdog says hello: loading its shared libraries holds the
    # GIL for seconds on a busy node, which would silence the heartbeats of a rank the
    # broker already counts (and fail a group that is only starting slowly).
    import torch.distributed  # noqa: F401

    context: zmq.Context[Any] = zmq.Context()
    link = Link(config, context)
    Watchdog(link).start()  # says hello and heartbeats while this thread starts up
    script.remember_interpreter_path()  # before the roots: a launch's path has none of them
    for root in reversed(config.roots):
        if root not in sys.path:
            sys.path.insert(0, root)
    init_process_group(config)
    pgroups.install()  # the code's own init/destroy of the default group meet the warm one
    preload_modules()
    load_hooks_from_env()
    cancel.install()
    pdb_relay.install()  # breakpoint() in a body fails, saying what to use instead
    importenv.start_done()
    # What the ready rank holds (torch, its preloads) is never garbage a caller made: frozen
    # out of every later collection, the full one after each caller (the GPU-memory check,
    # carryover.unfit_after_caller) walks only the caller's objects: ~0.1 ms instead of
    # ~0.1 s with torch loaded (most of a warm launch's cost on the H200 host).
    gc.collect()
    gc.freeze()
    ready = protocol.RankReady(
        rank=config.rank,
        startup_s=time.monotonic() - started,
        rss_mb=_rss_mb(),
        features=sorted(protocol.ALL_FEATURES),
        bound_env=sorted(importenv.bound),
    )
    # Fields the broker that spawned us cannot read stay home (see protocol.FEATURE_FIELDS).
    features = frozenset(os.environ.get(protocol.FEATURES_ENV, "").split(","))
    check_code = "code-freshness" in features  # an older broker could not act on "stale"
    check_env = check_code and "import-env" in features
    bound_said = len(importenv.bound)
    watch.scan(started_ns)
    link.take()
    link.send(protocol.encode_for(ready, features))
    log.info(
        "ready after %.2fs (spinning %d us after a report, cpq.spin)",
        ready.startup_s,
        round(link.spinner.window_s * 1e6),
    )
    baseline = Baseline.capture()
    carried = carryover.Carryover.capture()
    boundary.mark_ready()  # the modules every later session and launch starts from
    exits.install()  # a session's atexit handlers run at its boundary (cpq.rank.exits)
    boundary.on_forget(watch.forget)  # a forgotten module's file is read afresh, not watched
    capture = FdCapture(protocol.MAX_CAPTURE_BYTES)
    link.output_so_far = capture.so_far  # with a stack dump: what a stuck rank printed
    if check_code and "idle-stale" in features:
        link.on_idle = _idle_code_check(link, watch, config)
    last_env: dict[str, str] | None = None
    profile = TaskProfile.from_env(config.rank)
    while (task := link.next_task()) is not None:
        tracepoints.mark(task.task_id, "rank has the task")
        link.give()  # the watchdog heartbeats for a task that outlasts its tick
        profile.begin()
        if task.env_same:  # the broker left out the variables: the previous task's
            task.env = last_env
        last_env = task.env
        task_started_ns = time.time_ns()
        # Inside one calling session the code is what its first test here saw, as in one
        # fresh pytest process (which never reads an edit made after its imports either):
        # the check runs when a session, a launch or a function task begins, and so does
        # the boundary between callers (cpq.rank.carryover).
        continuing = items.continues(task)
        state = "" if continuing else _cross_boundary(task, carried)
        carried.restored = False  # the task runs: it may set any switch
        stale = state or (watch.changed() if check_code and not continuing else "")
        tracepoints.mark(task.task_id, "rank checked")
        stale_kind: protocol.StaleKind = "code" if stale else ""
        if state and "state-refusal" in features:
            stale_kind = "state"
        stale_start = False
        ran = Ran()
        if stale:  # run nothing: the broker sends the task to a fresh group
            log.info("not running %s: %s changed since this group loaded it", task.target, stale)
            result = protocol.RankResult(rank=config.rank, outcome="error")
        else:
            items.began = _began_sender(link, task.task_id, config.rank, features)
            result, ran = run_task(task, config.rank, baseline, capture, check_env)
            tracepoints.mark(task.task_id, "rank ran it")
            items.began = None
            if ran.variable:
                stale, stale_kind, stale_start = ran.variable, "variable", ran.at_start
                if "refusal-kind" not in features:  # a broker that reads words, not the kind
                    stale = f"the variable {ran.variable}"
                log.info("not running %s: an import read %s", task.target, ran.variable)
            if check_code:
                watch.scan(task_started_ns)
        bound_env: list[str] = []
        if len(importenv.bound) != bound_said:
            bound_said = len(importenv.bound)
            bound_env = sorted(importenv.bound)
        unfit = "" if stale else _after_caller(task, result, carried, baseline)
        cuda_mb, cuda_reserved_mb = _cuda_now_mb()
        done = protocol.RankDone(
            task_id=task.task_id,
            result=result,
            rss_mb=_rss_mb(),
            cuda_mb=cuda_mb,
            cuda_reserved_mb=cuda_reserved_mb,
            unfit=unfit or _unfit_reason(),
            stale=stale,
            stale_kind=stale_kind,
            # Read by the broker after a cancel (Tasks._interrupted), which may still be
            # unread on this socket when a short task ends: every multi-rank report has it.
            pg_seq=_pg_sequence() if config.world_size > 1 else -1,
            bound_env=bound_env,
            stale_start=stale_start,
            coverage=ran.coverage[0] if ran.coverage else b"",
        )
        try:
            frame = protocol.encode_for(done, features)
        except protocol.EncodeError as exc:
            result.stdout = result.stderr = ""
            done.coverage = b""  # everything that can grow goes: the report must get through
            why = f"{exc} (this rank's output and coverage data were dropped)"
            result.error = protocol.RankError("cpq.EncodeError", why[:4000])
            result.outcome, result.value = "failed", None
            frame = protocol.encode_for(done, features)
        profile.end()
        tracepoints.mark(task.task_id, "rank sends its report")
        link.take()
        link.send(frame)
        if task.debug and result.outcome == "failed":
            pdb_relay.serve(link, task.task_id)  # until the broker says: debug or let go
        if not items.in_session() and not stale and not done.unfit:  # a boundary comes next
            carried.restore_while_idle()
        if ahead.pending() and not done.unfit:  # idle now: the watchdog holds the socket
            link.give()
            ahead.warm(task_waits=lambda: bool(link.tasks))
            link.take()
            carried.restored = False
    log.info("shutting down")
    hard_exit(0)


if __name__ == "__main__":
    main()
