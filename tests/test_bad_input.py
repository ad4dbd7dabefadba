"""Bad input: whatever reaches the broker, it answers with a clear error or drops and logs
it, and keeps serving.

tests/test_core.py already sends the classic malformed frames to the frontend (garbage,
empty, not a map, wrong or missing version, unknown kind, extra frames, wrong field types,
bad env pairs, NUL bytes, a rank message from a client, an oversized frame) and the
impossible requests through the client API (world size 0 / -1 / 10**6, a target without
``:``, bad timeouts). Here: the same requests as raw frames, nesting and map-key attacks,
the rank-facing backend socket, the client-side checks, and fuzzing (the decoder with
hypothesis; the live broker through a raw DEALER). Nothing here starts a group except the
shared warm one that proves the broker still serves.
"""

from __future__ import annotations

import datetime
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import ROOT, broker_reply, start_broker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpq import Client, EncodeError, protocol, wirecheck
from cpq.client.autostart import stop_broker

WS = 2
NOOP = "workers.collectives:noop"


def wire(**fields: Any) -> bytes:
    return msgpack.packb({"v": protocol.PROTOCOL_VERSION, **fields}, use_bin_type=True)


def spec(**changes: Any) -> dict[str, Any]:
    return {"world_size": WS, "python": sys.executable, "roots": [str(ROOT)], "env": [], **changes}


def submit(task_id: str = "raw", **changes: Any) -> bytes:
    return wire(**{"k": "submit", "task_id": task_id, "target": NOOP, "spec": spec(), **changes})


def deep_kwargs(depth: int) -> bytes:
    """A submit whose kwargs hold a list nested ``depth`` deep, written byte by byte
    (msgpack's packer itself refuses to build it)."""
    fields = {"v": protocol.PROTOCOL_VERSION, "k": "submit", "task_id": "deep", "target": NOOP}
    fields["spec"] = spec()  # type: ignore[assignment]
    body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items())
    nested = b"\x81" + msgpack.packb("x") + b"\x91" * depth + b"\xc0"
    return bytes([0x80 | (len(fields) + 1)]) + body + msgpack.packb("kwargs") + nested


@pytest.fixture
def raw(raw_dealer: zmq.Socket[Any]) -> zmq.Socket[Any]:
    """A raw DEALER on the shared broker's frontend: no client library, no hello."""
    return raw_dealer


def serves(client: Client) -> None:
    result = client.submit(NOOP, WS)
    assert result.outcome == "passed", (result.outcome, result.message)


# --------------------------------------------------------------------------- raw frontend

REJECTED = [
    # A well-formed submit that can never run: a ``done`` with outcome error, at once.
    pytest.param(submit(spec=spec(world_size=0)), "world_size must be at least 1, got 0", id="ws0"),
    pytest.param(submit(spec=spec(world_size=-1)), "world_size must be at least 1", id="ws-1"),
    pytest.param(submit(spec=spec(world_size=10**6)), "world_size 1000000 exceeds", id="ws1e6"),
    pytest.param(submit(spec=spec(world_size=2**64 - 1)), "exceeds", id="ws-uint64-max"),
    pytest.param(submit(target="workers.collectives.noop"), "must look like", id="no-colon"),
    pytest.param(submit(target="workers.collectives:"), "must look like", id="no-function"),
    pytest.param(submit(spec=spec(python="python3")), "is not an executable", id="relative-python"),
    pytest.param(
        submit(spec=spec(python="/nonexistent/python")), "is not an executable", id="no-python"
    ),
    pytest.param(submit(spec=spec(backend="carrier-pigeon")), "unknown torch.distributed backend",
                 id="bad-backend"),
    pytest.param(submit(timeout=-1.0), "timeout must be a positive, finite", id="negative-timeout"),
    pytest.param(submit(timeout=float("inf")), "finite number", id="infinite-timeout"),
    pytest.param(submit(timeout=float("nan")), "finite number", id="nan-timeout"),
]  # fmt: skip


@pytest.mark.parametrize(("frame", "words"), REJECTED)
def test_request_that_can_never_run_is_rejected_at_once(
    raw: zmq.Socket[Any], frame: bytes, words: str
) -> None:
    raw.send(frame)
    answer = broker_reply(raw)
    assert answer["k"] == "done", answer
    assert answer["result"]["outcome"] == "error"
    assert answer["result"]["task_id"] == "raw"
    assert words in answer["result"]["message"], answer["result"]["message"]


MALFORMED = [
    pytest.param(deep_kwargs(10_000), "not valid msgpack", id="kwargs-10000-deep"),
    pytest.param(submit(kwargs={"x": {1: "int key"}}), "int is not allowed for map key",
                 id="int-map-key"),
    pytest.param(wire(**{"k": "status", "x" * 100: 1}), "unknown field", id="long-unknown-field"),
    pytest.param(submit(spec=spec(world_size=True)), "expected int, got bool", id="ws-bool"),
    pytest.param(submit(spec=spec(world_size=2.0)), "expected int, got float", id="ws-float"),
    pytest.param(submit(spec=spec(roots="/tmp")), "expected a list", id="roots-not-a-list"),
    pytest.param(submit(kwargs=None), "expected a map", id="kwargs-nil"),
    pytest.param(wire(k=None), "unknown message kind None", id="kind-nil"),
    pytest.param(wire(k=["submit"]), "unknown message kind", id="kind-list"),
    pytest.param(msgpack.packb({"v": 1, "k": "status"}) + b"\x00", "not valid msgpack",
                 id="trailing-bytes"),
    pytest.param(msgpack.packb({"v": 1, "k": "status"})[:-1], "not valid msgpack", id="truncated"),
    pytest.param(msgpack.packb(msgpack.ExtType(1, b"x")), "must be a map", id="ext-type"),
    pytest.param(wire(k="welcome"), "'welcome' is not a client message", id="broker-message"),
    pytest.param(wire(k="done", result={"task_id": "x", "outcome": "passed"}),
                 "'done' is not a client message", id="done-from-client"),
]  # fmt: skip


@pytest.fixture(scope="module")
def counting_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A broker of this module's own: the shared one counts every xdist worker's malformed
    frames (test_core's, test_faults'), so a count taken there races theirs."""
    process, endpoint = start_broker(tmp_path_factory.mktemp("counting") / "state")
    try:
        yield endpoint
    finally:
        stop_broker(process)


@pytest.mark.parametrize(("frame", "words"), MALFORMED)
def test_malformed_frame_is_answered_with_an_error(
    counting_broker: str, frame: bytes, words: str
) -> None:
    context = zmq.Context.instance()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(counting_broker)
    try:
        with Client(counting_broker, name="counting") as client:
            before = client.status()["totals"]["malformed"]
            raw.send(frame)
            answer = broker_reply(raw)
            assert answer["k"] == "error", answer
            assert words in answer["message"], answer["message"]
            if "client message" not in words:  # decodes fine, it is just not for the broker
                assert client.status()["totals"]["malformed"] == before + 1
    finally:
        raw.close()


def test_raw_requests_leave_the_broker_serving(tmp_path: Path) -> None:
    # A broker of its own: the shared one's queue holds other files' tasks under xdist.
    process, endpoint = start_broker(tmp_path / "state", "--max-ranks", "2", "--memory", "0")
    context = zmq.Context.instance()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(endpoint)
        for frame, _ in (p.values for p in [*REJECTED, *MALFORMED]):
            raw.send(frame)
        for _ in range(len(REJECTED) + len(MALFORMED)):
            assert broker_reply(raw)["k"] in ("done", "error")
        with Client(endpoint, name="after-raw") as private:
            serves(private)
            assert private.status()["queue"] == []  # nothing was queued by any of them
    finally:
        raw.close()
        stop_broker(process)


# --------------------------------------------------------------------------- client side


def test_client_refuses_what_the_broker_could_not_decode(broker: str) -> None:
    """Checked before sending, naming the argument. (Before the fix, int map keys went out,
    the broker refused the frame, and the caller's future waited forever.)"""
    deep: Any = None
    for _ in range(10_000):
        deep = [deep]
    with Client(broker, name="refused-arguments") as client:
        with pytest.raises(EncodeError, match=r"argument 'nested' \(a list\).*recursion limit"):
            client.submit(NOOP, WS, {"nested": deep})
        with pytest.raises(EncodeError, match=r"argument 'table' \(a dict\).*map key"):
            client.submit_async(NOOP, WS, {"table": {1: "one"}}).result(timeout=10)
        with pytest.raises(EncodeError, match=r"argument 'when' \(a datetime\)"):
            client.submit(NOOP, WS, {"when": datetime.datetime.now()})
        # this client's own count (the shared broker serves other tests' clients meanwhile)
        [mine] = [c for c in client.status()["clients"] if c["name"] == "refused-arguments"]
        assert mine["submitted"] == 0


# --------------------------------------------------------------------------- raw backend


def test_backend_socket_drops_and_logs_what_no_rank_would_send(
    client: Client, broker_state: Path
) -> None:
    """The socket ranks connect to: garbage, wrong frame counts, a hello with a wrong
    token, reports from a peer that never said hello. Dropped (ranks get no error
    replies), logged, and the broker keeps serving."""
    status = client.status()
    pid = status["broker"]["pid"]
    backend = f"ipc://{broker_state / f'backend-{pid}.sock'}"
    before = status["totals"]["malformed"]
    groups = [p["id"] for p in status["pools"]] or ["g1"]
    context: zmq.Context[Any] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(backend)
    try:
        sock.send(b"\xc1 garbage")
        sock.send_multipart([wire(k="hb"), b"extra"])
        sock.send(
            wire(k="rank_hello", group_id=groups[0], token="0" * 32, rank=0, local_rank=0, pid=1)
        )
        sock.send(wire(k="rank_hello", group_id="g-none", token="x", rank=0, local_rank=0, pid=1))
        sock.send(wire(k="rank_done", task_id="t", result={"rank": 0, "outcome": "passed"}))
        sock.send(wire(k="rank_ready", rank=0))
        assert not sock.poll(500), "the backend answered an unknown peer"
    finally:
        sock.close(0)
        context.term()
    serves(client)
    # garbage, two frames, and the two reports of a peer that never said hello: junk, counted
    # (the hellos with a wrong token are refused by the pools, and logged)
    # (at least: the shared broker also counts what other xdist workers' tests send it)
    assert client.status()["totals"]["malformed"] >= before + 4
    log = (broker_state / "logs" / "broker.log").read_text()
    assert "malformed message from rank peer" in log
    assert "dropping a message of 2 frames" in log
    assert f"refusing rank hello for group {groups[0]}" in log
    assert "refusing rank hello for group g-none" in log
    assert "dropping 'rank_done' from an unknown rank peer" in log
    assert "dropping 'rank_ready' from an unknown rank peer" in log


# --------------------------------------------------------------------------- fuzzing

KINDS = sorted(protocol._KINDS)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
trees = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.sampled_from(["rank", "spec", "env"]), inner,
                      max_size=4),
    max_leaves=6,
)  # fmt: skip


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """Frames that look like messages: right version (mostly), real kinds, real field names
    with values of any type, and sometimes extra or missing fields."""
    kind = draw(st.sampled_from([*KINDS, "nope"]))
    cls = protocol._KINDS.get(kind)
    names = list(wirecheck.hints(cls)) if cls else []
    fields = {name: draw(trees) for name in names if draw(st.booleans())}
    if names and "spec" in names and draw(st.booleans()):
        fields["spec"] = draw(st.fixed_dictionaries({"world_size": trees, "python": trees,
                                                     "roots": trees, "env": trees}))  # fmt: skip
    data = {"v": draw(st.sampled_from([1, 1, 1, 0, 2, None])), "k": kind, **fields}
    return msgpack.packb(data, use_bin_type=True)


VALID = [
    protocol.encode(protocol.Submit(task_id="t", target=NOOP, spec=protocol.PoolSpec(
        world_size=2, python=sys.executable, roots=["/r"], env=[["A", "1"]]),
        kwargs={"a": [1, 2.5, "x", b"y", None, {"b": True}]})),
    protocol.encode(protocol.RankDone(task_id="t", result=protocol.RankResult(
        rank=1, outcome="failed", error=protocol.RankError("E", "m", "tb"), value={"k": [1]}))),
    protocol.encode(protocol.Warm(specs=[protocol.PoolSpec(2, "/p", ["/r"])], counts=[2])),
    protocol.encode(protocol.RankHello(group_id="g1", token="t", rank=0, local_rank=0, pid=9)),
]  # fmt: skip


@st.composite
def mutations(draw: st.DrawFn) -> bytes:
    """Valid frames with bytes flipped, inserted, deleted or cut off."""
    frame = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        at = draw(st.integers(0, max(0, len(frame) - 1)))
        if op == "flip" and frame:
            frame[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del frame[at : at + draw(st.integers(1, 4))]
        else:
            del frame[at:]
    return bytes(frame)


def decode_only_protocol_errors(frame: bytes) -> None:
    try:
        message = protocol.decode(frame)
    except protocol.ProtocolError:
        return
    # What decodes is a real message that encodes again (nothing half-checked gets through).
    assert isinstance(message, protocol.Message)
    protocol.decode(protocol.encode(message))


def fuzz(examples: int) -> Any:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@fuzz(2000)
@given(st.binary(max_size=300))
def test_decoder_fuzz_random_bytes(frame: bytes) -> None:
    decode_only_protocol_errors(frame)


@fuzz(600)
@given(messages())
def test_decoder_fuzz_message_shaped(frame: bytes) -> None:
    decode_only_protocol_errors(frame)


@fuzz(1500)
@given(mutations())
def test_decoder_fuzz_mutated_valid_frames(frame: bytes) -> None:
    decode_only_protocol_errors(frame)


def test_valid_frames_round_trip() -> None:
    for frame in VALID:
        assert protocol.encode(protocol.decode(frame)) == frame


CLIENT_KINDS = {"hello", "hb", "bye", "status", "stop", "submit", "cancel", "warm"}
# Kinds a fuzzed frame must not turn into when sent to the live, shared broker.
ACTING = (protocol.StopRequest, protocol.Submit, protocol.Warm, protocol.Cancel)


def test_live_broker_fuzz_through_a_raw_dealer(raw: zmq.Socket[Any], client: Client) -> None:
    """500 seeded random frames (junk, message-shaped, mutated) at the live broker; every
    one that does not decode is answered with an error; then a real task still passes."""
    rng = random.Random(20261129)
    frames: list[bytes] = []
    while len(frames) < 500:
        choice = rng.random()
        if choice < 0.3:
            frame = rng.randbytes(rng.randrange(0, 200))
        else:
            data = bytearray(rng.choice(VALID) if choice < 0.8 else wire(k="status"))
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(len(data)) if data else 0
                if data and rng.random() < 0.6:
                    data[at] ^= 1 << rng.randrange(8)
                else:
                    del data[at:]
            frame = bytes(data)
        try:
            decoded = protocol.decode(frame)
        except protocol.ProtocolError:
            decoded = None
        if not isinstance(decoded, ACTING):  # never stop the shared broker or start groups
            frames.append(frame)
    malformed = refused = 0  # frames that do not decode; decoded kinds no client may send
    for frame in frames:
        try:
            kind = protocol.decode(frame).KIND
        except protocol.ProtocolError:
            malformed += 1
        else:
            refused += kind not in CLIENT_KINDS
    before = client.status()["totals"]["malformed"]
    for frame in frames:
        raw.send(frame)
    errors = 0
    deadline = time.monotonic() + 30
    while errors < malformed + refused and time.monotonic() < deadline:
        if raw.poll(1000) and msgpack.unpackb(raw.recv(), raw=False).get("k") == "error":
            errors += 1
    assert errors == malformed + refused and malformed > 300
    # Kinds no client may send are dropped and counted with the undecodable ones.
    assert client.status()["totals"]["malformed"] - before == malformed + refused
    serves(client)
