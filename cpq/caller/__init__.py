"""The warm caller: a process that has imported what a project's pytest sessions import,
and forks one calling session per ``pytest --cpq-world-size`` run (docs/design.md, "The warm
caller").

A ``--cpq-world-size`` session is a pytest process that loads the suite's conftests and
collects before any test runs on the ranks; on a suite whose root conftest imports the world
(Megatron-LM's: torch and ``megatron.core``, ~15 s on the GPU host) that start is most of a
warm session. The warm caller pays it once: the session's pytest process hands its command
line, variables, working directory and standard streams over (:mod:`cpq.client.handoff`),
and a fork of this process runs the session (:mod:`cpq.caller.child`) while the process the
shell started waits, relays signals and exits with the fork's status.

Modules: :mod:`~cpq.caller.wire` (the socket, the messages, the key and the plan file),
:mod:`~cpq.caller.server` (the process: imports, checks, forks, reports exits),
:mod:`~cpq.caller.child` (the fork becoming the calling process).
"""
