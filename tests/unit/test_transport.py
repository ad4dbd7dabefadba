"""The broker's sends to a client that cannot keep up (cpq/broker/transport.py): nothing is
lost, nothing overtakes an earlier frame, heartbeats do not pile up, and a client that stops
reading for good is dropped instead of growing the broker's memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from cpq.broker import transport
from cpq.broker.config import BrokerConfig


class Pipe:
    """A stand-in for the frontend ROUTER: ``room`` frames fit, then ``zmq.Again``."""

    def __init__(self) -> None:
        self.room: int | None = None  # None: unbounded
        self.delivered: list[tuple[bytes, bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        if self.room is not None:
            if self.room == 0:
                raise zmq.Again()
            self.room -= 1
        self.delivered.append((frames[0], frames[1]))


def make(tmp_path: Path) -> tuple[transport.Transport, Pipe, list[bytes]]:
    config = BrokerConfig(endpoint="ipc://x", state_dir=tmp_path, log_dir=tmp_path)
    sender = transport.Transport(config)
    pipe = Pipe()
    sender.frontend = pipe  # type: ignore[assignment]
    gone: list[bytes] = []
    sender.on_client_gone = gone.append
    return sender, pipe, gone


def frames_to(pipe: Pipe, identity: bytes) -> list[bytes]:
    return [f for who, f in pipe.delivered if who == identity]


def test_a_slow_clients_frames_arrive_all_and_in_order(tmp_path: Path) -> None:
    sender, pipe, gone = make(tmp_path)
    pipe.room = 2
    for n in range(10):
        sender.send_client(b"slow", f"reply {n}".encode())
        sender.send_heartbeats([b"slow"], [])
    pipe.room = 3
    sender.flush_outbox()
    pipe.room = None
    sender.send_client(b"slow", b"reply 10")  # the pipe has room again: still behind
    sender.flush_outbox()
    sender.send_client(b"slow", b"reply 11")
    replies = [f for f in frames_to(pipe, b"slow") if f.startswith(b"reply")]
    assert replies == [f"reply {n}".encode() for n in range(12)]
    heartbeats = len(frames_to(pipe, b"slow")) - len(replies)
    assert heartbeats <= 2  # those that went out before the backlog: none queued behind
    assert gone == []


def test_another_client_is_served_while_one_is_behind(tmp_path: Path) -> None:
    sender, pipe, _ = make(tmp_path)
    pipe.room = 0
    sender.send_client(b"slow", b"first")
    pipe.room = None
    sender.send_client(b"quick", b"answer")
    assert frames_to(pipe, b"quick") == [b"answer"] and frames_to(pipe, b"slow") == []


def test_a_client_that_stops_reading_is_dropped_not_hoarded(tmp_path: Path) -> None:
    sender, pipe, gone = make(tmp_path)
    pipe.room = 0
    for n in range(transport.MAX_BACKLOG + 1):
        sender.send_client(b"stuck", b"x%d" % n)
    assert gone == [b"stuck"]
    pipe.room = None
    sender.flush_outbox()
    assert frames_to(pipe, b"stuck") == []  # its backlog was let go


def test_an_unreachable_client_is_reported_gone(tmp_path: Path) -> None:
    sender, pipe, gone = make(tmp_path)

    def unreachable(frames: list[bytes], flags: int = 0) -> Any:
        raise zmq.ZMQError(zmq.EHOSTUNREACH)

    pipe.send_multipart = unreachable  # type: ignore[method-assign]
    sender.send_client(b"left", b"verdict")
    assert gone == [b"left"]
