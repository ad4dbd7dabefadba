"""Submit options an older broker would not honour are refused, never silently dropped.

A client may talk to a broker of an older cpq (an embedded broker outlives ``pip install
-U cpq``). :func:`cpq.protocol.encode_for` leaves out the fields of features the broker does
not read, so that it can decode the rest; for most fields that is harmless, but for these
options it would change what the test means: its coverage would be lost, it would share
groups with other sessions, draw from a fixed seed instead of the caller's random state,
be retried more often than a rerun plugin expects, fail without its post-mortem, or be
"confirmed" on a warm group. So a
submit that asks for one of them from a broker without its feature fails at once, saying
how to get a current broker (fail closed).
"""

from __future__ import annotations

from cpq import protocol
from cpq.specs import BadRequest


def refuse_unread_options(
    message: protocol.Submit, features: frozenset[str], endpoint: str
) -> None:
    """Raise :class:`BadRequest` when ``message`` asks for an option whose feature the
    broker at ``endpoint`` (which reads ``features``) lacks."""
    for asked, feature in (
        (message.coverage, "task-coverage"),
        (message.own_groups, "session-groups"),
        (message.fresh_group, "fresh-group"),  # else a warm group would "confirm" it
        (message.rng, "task-rng"),  # else the ranks draw from the fixed seed
        (message.retries != 1, "task-retries"),  # else a rerun plugin's attempts double
        (message.debug_rank is not None, "pdb-relay"),
    ):
        if asked and feature not in features:
            raise BadRequest(
                f"the broker at {endpoint} is too old for {feature!r} "
                "(stop it with `cpq stop`; the next session starts a current one)"
            )
