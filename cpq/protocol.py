"""The wire protocol: the one module the broker, its clients and the worker runtime share.

Every ZeroMQ message carries exactly one payload frame (after the routing id a ROUTER adds):
a msgpack map ``{"v": PROTOCOL_VERSION, "k": <kind>, ...fields}``. Each kind is one dataclass
below, so the set of messages is written down in one place and checked on the way in:
``decode`` rejects wrong versions, unknown kinds, missing or extra fields and wrong types with
a :class:`ProtocolError`, and never executes anything (msgpack only; no pickle crosses the
wire). Size limits are enforced twice: ZeroMQ's ``MAXMSGSIZE`` drops oversized frames before
they are read, and the unpacker bounds every string, binary, array and map it builds.
Fields and kinds added within protocol 1 are listed per feature in :mod:`cpq.features`; a
sender leaves out what its peer does not read (:func:`encode_for`).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin

import msgpack

from cpq import environ  # the other shared leaf: which variables are start variables
from cpq.features import ALL_FEATURES as ALL_FEATURES  # the versioning policy, re-exported
from cpq.features import FEATURE_FIELDS as FEATURE_FIELDS
from cpq.features import FEATURE_KINDS as FEATURE_KINDS
from cpq.features import FEATURES_ENV as FEATURES_ENV
from cpq.features import drop, reads_kind, unread_fields
from cpq.records import OUTCOMES as OUTCOMES  # the records messages carry, re-exported
from cpq.records import Cause as Cause
from cpq.records import Outcome as Outcome
from cpq.records import PoolSpec as PoolSpec
from cpq.records import RankError as RankError
from cpq.records import RankResult as RankResult
from cpq.records import StaleKind as StaleKind
from cpq.records import TaskResult as TaskResult
from cpq.wirecheck import ProtocolError as ProtocolError  # re-exported: part of the API
from cpq.wirecheck import checker, hints
from cpq.wirefast import encoder, record_checker

PROTOCOL_VERSION = 1

#: Largest frame any socket accepts (ZeroMQ ``MAXMSGSIZE``); bigger frames are dropped.
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: Bound on one captured stream (stdout or stderr) of one rank for one task.
MAX_CAPTURE_BYTES = 256 * 1024

#: The target of a test the ranks' pytest runs (``cpq.rank.items.run_item``): its deadline
#: starts when the test's protocol begins (``RankBegun``), not when the rank gets it.
PYTEST_ITEM_TARGET = "cpq.rank.items:run_item"
RETRY_NOTE = "[CPQ-RETRY]"
RETRY_FAIL_NOTE = "[CPQ-RETRY-FAIL]"

# Variables that keep NVLink multicast off (owned by cpq.environ, which forces them on every
# group and every task); re-exported here, where tools and tests have long found them.
MULTICAST_OFF_ENV = environ.MULTICAST_OFF_ENV


class EncodeError(TypeError):
    """A value that cannot travel (not msgpack-able, too deep, too big)."""


# --------------------------------------------------------------------------- messages

_KINDS: dict[str, type[Message]] = {}


@dataclass
class Message:
    KIND: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("KIND")
        if kind:
            _KINDS[kind] = cls


# ---- client -> broker


@dataclass
class Hello(Message):
    """First message of a client: who it is (shown by cpq-status)."""

    KIND: ClassVar[str] = "hello"
    client: dict[str, Any] = field(default_factory=dict)


@dataclass
class Submit(Message):
    KIND: ClassVar[str] = "submit"
    task_id: str
    target: str
    spec: PoolSpec
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    seed: int = 1234
    test_id: str = ""
    #: The caller's task variables (see :mod:`cpq.environ`); None: a client that sends
    #: none, whose tasks run with the group's baseline environment.
    env: dict[str, str] | None = None
    #: With several idle groups of the spec, prefer the one that last ran this key
    #: (``cpq.broker.affinity``); "": no preference.
    affinity: str = ""
    #: ``env`` is left out: the task's variables are those of this client's previous
    #: submit (feature ``env-delta``; a test session rarely changes them, and decoding ~40
    #: variables per hop was the largest CPU cost of a small task).
    env_same: bool = False
    #: Infra failures (deadline, dead rank, a group that would not start) this task may be
    #: run again for, each on a fresh group (feature ``task-retries``; 0: none, as when a
    #: rerun plugin such as pytest-rerunfailures reruns the test itself).
    retries: int = 1
    #: ``pytest --pdb``: keep a failing rank's frame for a post-mortem relayed to the client
    #: (feature ``pdb-relay``). -1: the lowest failing rank; N: rank N when it failed.
    debug_rank: int | None = None
    #: See :class:`RunTask`: the caller's random state and coverage configuration.
    rng: dict[str, Any] | None = None
    coverage: dict[str, Any] | None = None
    #: The caller's test session ("": the client itself); an xdist run's workers share one.
    session: str = ""
    #: Run only on a group that served no other session (a spare, or one this session
    #: used): nothing a test of another session left in module globals reaches this one.
    own_groups: bool = False
    #: Run only on a group started for this task (feature ``fresh-group``): it served no
    #: task before, as a new ``torchrun -m pytest`` process has run none (``pytest
    #: --cpq-confirm-fresh``; docs/design.md, "Confirm on a fresh group").
    fresh_group: bool = False


@dataclass
class Cancel(Message):
    """Drop a queued task, or interrupt a running one (its group is cleaned or recycled)."""

    KIND: ClassVar[str] = "cancel"
    task_id: str


@dataclass
class Warm(Message):
    """Start groups for these specs now (the pytest plugin sends it after collection)."""

    KIND: ClassVar[str] = "warm"
    specs: list[PoolSpec]
    counts: list[int] = field(default_factory=list)


@dataclass
class StatusRequest(Message):
    KIND: ClassVar[str] = "status"


@dataclass
class StopRequest(Message):
    """``cpq stop``: drain=True finishes running tasks first and accepts nothing new."""

    KIND: ClassVar[str] = "stop"
    drain: bool = False


@dataclass
class Goodbye(Message):
    KIND: ClassVar[str] = "bye"


# ---- broker -> client


@dataclass
class Welcome(Message):
    KIND: ClassVar[str] = "welcome"
    broker: dict[str, Any] = field(default_factory=dict)


@dataclass
class Done(Message):
    KIND: ClassVar[str] = "done"
    result: TaskResult


@dataclass
class StatusReply(Message):
    KIND: ClassVar[str] = "status_reply"
    status: dict[str, Any]


@dataclass
class ErrorReply(Message):
    """An answer to a message the broker could not act on; the broker keeps serving."""

    KIND: ClassVar[str] = "error"
    message: str
    task_id: str = ""


@dataclass
class Waiting(Message):
    """A queued task is still waiting for a group, and why (sent after a few seconds)."""

    KIND: ClassVar[str] = "waiting"
    task_id: str
    message: str


@dataclass
class Closing(Message):
    """The broker is going away (stopped, drained, idle): clients hear why, at once."""

    KIND: ClassVar[str] = "closing"
    reason: str


# ---- both directions, every peer


@dataclass
class Heartbeat(Message):
    KIND: ClassVar[str] = "hb"


# ---- rank -> broker


@dataclass
class RankHello(Message):
    """Sent by a rank's watchdog thread as soon as it connects, before the process group exists."""

    KIND: ClassVar[str] = "rank_hello"
    group_id: str
    token: str
    rank: int
    local_rank: int
    pid: int


@dataclass
class RankReady(Message):
    """The rank's process group is initialised; it can take tasks."""

    KIND: ClassVar[str] = "rank_ready"
    rank: int
    startup_s: float = 0.0
    #: Resident memory once ready: the baseline ``--max-rss-growth`` measures growth from.
    #: Optional (defaults to 0) so a rank of an older cpq 0.1 still decodes.
    rss_mb: float = 0.0
    #: The optional features this rank reads (a rank may run an older cpq than its broker:
    #: the spec's interpreter is the client's).
    features: list[str] = field(default_factory=list)
    #: Variables read while modules were imported during start-up (names only: values may
    #: be secrets); they bind every group of the spec (``cpq.rank.importenv``).
    bound_env: list[str] = field(default_factory=list)


@dataclass
class RankDone(Message):
    """One rank's report on one task, with the rank's memory right after it.

    The memory fields ride on this message (not on heartbeats) because memory only changes
    meaningfully across tasks; they feed ``cpq-status`` and recycling. The CUDA fields are
    ``torch.cuda.memory_allocated()``/``memory_reserved()`` (0 without CUDA) and default to 0
    so a rank of an older cpq 0.1 still decodes.
    """

    KIND: ClassVar[str] = "rank_done"
    task_id: str
    result: RankResult
    rss_mb: float = 0.0
    cuda_mb: float = 0.0
    cuda_reserved_mb: float = 0.0
    #: Non-empty: why this rank cannot serve another task (say, a task left it without free
    #: file descriptors); the broker recycles the group after this task. Optional, like above.
    unfit: str = ""
    #: Non-empty: the rank did not run the task because this file, which it loaded
    #: earlier, changed on disk since (``cpq.rank.freshness``), or an import read this
    #: variable (``cpq.rank.importenv``); the task goes to a fresh group. Which of the two,
    #: ``stale_kind`` says (an older rank's "the variable X" is read as code: a fresh group).
    stale: str = ""
    stale_kind: StaleKind = ""
    #: The default process group's collective sequence number after the task (-1: unknown).
    #: After a cancelled task, equal numbers on every rank mean no collective was left
    #: half-done and the group can serve again.
    pg_seq: int = -1
    #: Variables bound by imports so far (names only), sent when the set grew: shown by
    #: ``cpq-status``. With ``stale`` set by a variable, ``stale_start`` says it was read
    #: during the group's start-up, so a fresh group of the spec would read the same value.
    bound_env: list[str] = field(default_factory=list)
    stale_start: bool = False
    #: The coverage data of this rank's part of the task (``CoverageData.dumps()``; empty
    #: when the task asked for none).
    coverage: bytes = b""


@dataclass
class RankStacks(Message):
    KIND: ClassVar[str] = "rank_stacks"
    task_id: str
    rank: int
    stacks: str
    #: The phase of the test pytest runs in the rank (setup, call, teardown; "" none).
    phase: str = ""
    #: What the task wrote to fds 1 and 2 so far (feature ``stack-output``): a rank killed
    #: while stuck after a peer failed still shows what it printed, as under torchrun.
    stdout: str = ""
    stderr: str = ""


@dataclass
class RankStale(Message):
    """An idle rank, between callers, found a file it loaded changed on disk (feature
    ``idle-stale``): the broker stops its group now instead of when the next task would be
    refused, so that groups for code nobody runs any more do not pile up."""

    KIND: ClassVar[str] = "rank_stale"
    rank: int
    path: str


@dataclass
class RankBegun(Message):
    """A rank has built its pytest session and collected the test's module and now starts
    the test's protocol (feature ``rank-pytest``): the deadline counts from here, as
    pytest-timeout's does in a fresh run, not from the session's build. Sent again after
    the caller's last test, before the session's finish: that gets a window of the test's
    timeout of its own (the broker only ever extends a begun deadline)."""

    KIND: ClassVar[str] = "rank_begun"
    task_id: str
    rank: int


# ---- broker -> rank


@dataclass
class RunTask(Message):
    KIND: ClassVar[str] = "run"
    task_id: str
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    test_id: str = ""
    #: The caller's task variables (None: restore the rank's baseline environment).
    env: dict[str, str] | None = None
    #: ``env`` is left out: the variables are those of this group's previous task.
    env_same: bool = False
    #: A failing rank keeps the failure's frames until the broker says whether a
    #: post-mortem runs on it (:class:`DebugAttach`; feature ``pdb-relay``).
    debug: bool = False
    #: The caller's ``random``/``numpy`` global state to start the body with (``cpq.rng``);
    #: None: the fixed ``seed``.
    rng: dict[str, Any] | None = None
    #: Measure the body with this coverage configuration (``cpq.client.coverage_relay``).
    coverage: dict[str, Any] | None = None


@dataclass
class CancelTask(Message):
    """Interrupt the running task: its client went away."""

    KIND: ClassVar[str] = "cancel_task"
    task_id: str


@dataclass
class DumpStacks(Message):
    KIND: ClassVar[str] = "dump_stacks"
    task_id: str


@dataclass
class Shutdown(Message):
    KIND: ClassVar[str] = "shutdown"


# ---- the post-mortem relay (feature ``pdb-relay``): client <-> broker <-> one rank


@dataclass
class DebugAttach(Message):
    """Client -> broker -> rank: open (``start``) or give up the post-mortem of a failed
    task whose verdict named a ``debug_rank``; either way the group is recycled after."""

    KIND: ClassVar[str] = "debug_attach"
    task_id: str
    start: bool = True


@dataclass
class DebugLine(Message):
    """Client -> broker -> rank: one line the user typed at the debugger (``eof``: stdin
    closed, which pdb reads as ``EOF`` and quits)."""

    KIND: ClassVar[str] = "debug_line"
    task_id: str
    line: str = ""
    eof: bool = False


@dataclass
class DebugOutput(Message):
    """Rank -> broker -> client: what the debugger printed; ``prompt``: it now reads a
    line; ``ended``: the session is over (the user continued or quit (``quit``), or the
    rank died)."""

    KIND: ClassVar[str] = "debug_output"
    task_id: str
    text: str = ""
    prompt: bool = False
    ended: bool = False
    quit: bool = False


# --------------------------------------------------------------------------- encoding


def _to_wire(value: Any) -> Any:
    """Records become maps; user data (``Any`` fields) is left for msgpack as it is."""
    encoder = _encoder(type(value))
    return encoder(value) if encoder is not None else value


_ENCODERS: dict[type, Callable[[Any], dict[str, Any]] | None] = {}


def _encoder(cls: type) -> Callable[[Any], dict[str, Any]] | None:
    if cls in _ENCODERS:
        return _ENCODERS[cls]
    if not dataclasses.is_dataclass(cls):
        _ENCODERS[cls] = None
        return None
    plan = []
    for name, hint in hints(cls).items():
        nested = _nested_record(hint)
        plan.append((name, nested))

    def encode_record(value: Any) -> dict[str, Any]:
        out = {}
        for name, nested in plan:
            item = getattr(value, name)
            if nested == "one" and item is not None:
                item = _to_wire(item)
            elif nested == "list":
                item = [_to_wire(v) for v in item]
            out[name] = item
        return out

    _ENCODERS[cls] = encode_record
    return encode_record


def _nested_record(hint: Any) -> str:
    """Whether a field holds a record ("one"), a list of records ("list"), or plain data."""
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    for option in options:
        if dataclasses.is_dataclass(option):
            return "one"
        if get_origin(option) is list and dataclasses.is_dataclass(get_args(option)[0]):
            return "list"
    return ""


def to_wire(record: Any) -> Any:
    """A record (dataclass) as plain msgpack-able data."""
    return _to_wire(record)


def from_wire(cls: type[_T], data: Any) -> _T:
    """Check ``data`` against record type ``cls`` and build it (ProtocolError if off)."""
    return _from_wire(cls, data, cls.__name__)


def travel_problem(value: Any) -> str:
    """Why ``value`` cannot travel as task data (arguments, return values); "" if it can.

    A round trip, not just packing: msgpack packs maps with int keys, which the receiving
    side refuses to decode, and a message that cannot be decoded cannot name its task.
    """
    try:
        unpack(pack(value))
    except (EncodeError, ProtocolError) as exc:
        return str(exc.__cause__ or exc)
    return ""


def pack(value: Any) -> bytes:
    """msgpack with a clear error for what cannot travel."""
    try:
        frame: bytes = msgpack.packb(value, use_bin_type=True)
        return frame
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"cannot be sent to the broker as msgpack: {exc}") from exc


def unpack(frame: bytes) -> Any:
    try:
        # unpackb bounds every str/bin/array/map by the frame's own length, and the frame
        # is bounded by MAXMSGSIZE; its C stack limit refuses absurdly deep nesting.
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"not valid msgpack: {type(exc).__name__}: {exc}") from exc


def encode(message: Message) -> bytes:
    wire = encoder(type(message))(message)  # defaults left out (cpq.wirefast)
    wire["v"] = PROTOCOL_VERSION
    wire["k"] = message.KIND
    frame = pack(wire)
    if len(frame) > MAX_FRAME_BYTES:
        raise EncodeError(f"message of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return frame


# Optional fields and kinds per feature: :mod:`cpq.features` (re-exported here).


def peer_reads(message: Message, features: frozenset[str]) -> bool:
    """Whether a peer that reads ``features`` can decode a message of this kind at all."""
    return reads_kind(message.KIND, features)


def encode_for(message: Message, features: frozenset[str]) -> bytes:
    """:func:`encode`, without the fields of features the receiving peer does not read."""
    frame = encode(message)
    unread = unread_fields(message.KIND, features)
    if not unread:
        return frame
    wire = unpack(frame)
    for name in unread:
        drop(wire, name.split("."))
    return pack(wire)


Handlers = Mapping[type["Message"], Callable[[Any], None]]


def dispatch(frame: bytes, handlers: Handlers) -> str:
    """Decode ``frame`` and call the handler of its kind; "" when handled, else why it is
    junk (it does not decode, or its kind is not one ``handlers`` holds). The client and the
    ranks read the broker's frames through this, and count junk instead of acting on it."""
    try:
        message = decode(frame)
    except ProtocolError as exc:
        return f"a malformed frame: {exc}"
    handler = handlers.get(type(message))
    if handler is None:
        return f"{message.KIND!r}, which is not a message for this peer"
    handler(message)
    return ""


def decode(frame: bytes) -> Message:
    """Parse and check one payload frame; raise :class:`ProtocolError` on anything off."""
    data = unpack(frame)
    if not isinstance(data, dict):
        raise ProtocolError(f"a message must be a map, got {type(data).__name__}")
    version = data.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} not supported (this is {PROTOCOL_VERSION})"
        )
    kind = data.pop("k", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return _from_wire(cls, data, kind)


_T = TypeVar("_T")


_RECORDS: dict[type, Callable[[Any, str], Any]] = {}


def _from_wire(cls: type[_T], data: Any, where: str) -> _T:
    check = _RECORDS.get(cls)
    if check is None:  # the exact checker, behind its compiled fast path (cpq.wirefast)
        check = _RECORDS[cls] = record_checker(cls, checker(cls))
    return check(data, where)  # type: ignore[no-any-return]
