"""The numbers a warm caller reserves for a caller's descriptors (cpq.caller.descriptors).

Reserving fills a process's descriptor table from 3 to 255, so each case runs in a fresh
interpreter of its own, as the warm caller does."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(body: str) -> str:
    script = "import os, resource\nfrom cpq.caller import descriptors\n" + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_numbers_a_caller_may_pass_are_those_reserved_and_still_placeholders() -> None:
    out = _run(
        """
        reserved = descriptors.reserve()
        print(min(reserved), max(reserved), len(reserved))
        print(repr(descriptors.refusal([0, 1, 2, 7, 63])))
        print(repr(descriptors.refusal([0, 1, 2, 256])))
        print(repr(descriptors.refusal([0, 1, 2, 7, 7])))
        print(repr(descriptors.refusal([1, 0, 2])))
        os.close(9)
        r, w = os.pipe()
        os.dup2(r, 9)  # something else took the number since
        print(repr(descriptors.refusal([0, 1, 2, 9])))
        print(os.open(os.devnull, os.O_RDONLY) > descriptors.TOP)
        """
    )
    lines = out.splitlines()
    assert lines[0] == "3 255 253"
    assert lines[1] == "''"
    assert "descriptor 256 cannot be given that number" in lines[2]
    assert "given twice" in lines[3]
    assert "must start with 0, 1, 2" in lines[4]
    assert "descriptor 9 cannot be given that number" in lines[5]
    assert lines[6] == "True"  # what the warm caller opens lands above the reserved numbers


def test_installed_descriptors_are_at_their_numbers_and_the_rest_is_free() -> None:
    out = _run(
        """
        descriptors.reserve()
        r, w = os.pipe()  # lands above 255: what a caller's descriptor arrives as
        os.set_inheritable(w, False)
        descriptors.install([w], [7])
        os.write(7, b"through 7")
        print(os.read(r, 100).decode(), os.get_inheritable(7))
        print(os.open(os.devnull, os.O_RDONLY))  # the lowest free number, as in a fresh process
        """
    )
    assert out.splitlines() == ["through 7 True", "3"]


def test_a_low_descriptor_limit_reserves_nothing_and_refuses_all_but_0_to_2() -> None:
    out = _run(
        """
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        print(len(descriptors.reserve()))
        print(repr(descriptors.refusal([0, 1, 2])))
        print(repr(descriptors.refusal([0, 1, 2, 7])))
        """
    )
    lines = out.splitlines()
    assert lines[:2] == ["0", "''"]
    assert "reserved: no" in lines[2]
