"""A real client against a scripted broker socket: what it sends and what it believes.

The broker side is a bare ROUTER run by a thread of the test, so the client's behaviour
towards brokers cpq itself would never be (older ones, broken ones) can be scripted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from cpq import protocol
from cpq.client import BrokerUnavailable, Client

FEATURES = sorted(protocol.ALL_FEATURES)


Answer = Callable[[bytes, protocol.Message], bool]


class ScriptedBroker:
    """A ROUTER served by a thread: ``answer`` handles each message until it returns False."""

    def __init__(self, tmp_path: Path) -> None:
        self.endpoint = f"ipc://{tmp_path / 'b.sock'}"
        self.context: zmq.Context[Any] = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def send(self, identity: bytes, frame: bytes) -> None:
        self.sock.send_multipart([identity, frame])

    def start(self, answer: Answer) -> None:
        self.thread = threading.Thread(target=self._serve, args=(answer,), daemon=True)
        self.thread.start()

    def _serve(self, answer: Answer) -> None:
        while not self.stopped.is_set():
            if self.sock.poll(50):
                identity, frame = self.sock.recv_multipart()
                if not answer(identity, protocol.decode(frame)):
                    return

    def close(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.sock.close(0)
        self.context.term()


@pytest.fixture
def router(tmp_path: Path) -> Iterator[ScriptedBroker]:
    broker = ScriptedBroker(tmp_path)
    try:
        yield broker
    finally:
        broker.close()


@pytest.mark.parametrize("broker_reads_env_delta", [True, False])
def test_a_client_says_env_same_only_to_a_broker_that_reads_it(
    router: ScriptedBroker, broker_reads_env_delta: bool
) -> None:
    """A real client against a scripted broker socket: with the feature, an unchanged set
    of variables travels once; without it (an older broker), whole with every submit."""
    features = [f for f in FEATURES if broker_reads_env_delta or f != "env-delta"]
    endpoint = router.endpoint
    submits: list[protocol.Submit] = []

    def answer(identity: bytes, message: protocol.Message) -> bool:
        if isinstance(message, protocol.Hello):
            welcome = protocol.Welcome(broker={"features": features, "heartbeat_s": 1.0})
            router.send(identity, protocol.encode(welcome))
        elif isinstance(message, protocol.Submit):
            submits.append(message)
            done = protocol.Done(protocol.TaskResult(task_id=message.task_id, outcome="passed"))
            router.send(identity, protocol.encode(done))
        return len(submits) < 3

    router.start(answer)
    with Client(endpoint, name="env-delta") as client:
        for _ in range(3):
            assert client.submit("m:f", 1, roots=["/p"]).outcome == "passed"
    assert len(submits) == 3
    sent = [(s.env is not None, s.env_same) for s in submits]
    if broker_reads_env_delta:
        assert sent == [(True, False), (False, True), (False, True)]
    else:
        assert sent == [(True, False)] * 3
        assert submits[0].env == submits[2].env


def test_a_broker_that_sends_only_junk_is_a_silent_broker(
    router: ScriptedBroker,
) -> None:
    """Junk (frames that do not decode, kinds no broker sends a client) is counted and is
    no sign of life: the client gives the broker up as it would a silent one."""
    endpoint = router.endpoint
    junk = [b"\xc1", protocol.encode(protocol.RunTask(task_id="t", target="m:f"))]

    def answer(identity: bytes, message: protocol.Message) -> bool:
        if isinstance(message, protocol.Hello):
            welcome = protocol.Welcome(broker={"features": FEATURES, "heartbeat_s": 0.2})
            router.send(identity, protocol.encode(welcome))
        else:  # a heartbeat or a submit: answered by junk only, never by a heartbeat
            for frame in junk:
                router.send(identity, frame)
        return True

    router.start(answer)
    with Client(endpoint, name="junk", heartbeat_s=0.2, liveness=5) as client:
        started = time.monotonic()
        future = client.submit_async("m:f", 1, roots=["/p"], timeout=30)
        with pytest.raises(BrokerUnavailable, match="stopped answering"):
            future.result(timeout=10)  # 1 s of silence, not the task's deadline
        assert time.monotonic() - started < 10
        assert client.malformed >= 2
