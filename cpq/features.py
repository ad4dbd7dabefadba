"""What a peer of another cpq version reads: optional fields and message kinds, per feature.

A shared leaf beside :mod:`cpq.protocol` (which re-exports every name here and encodes with
it, :func:`cpq.protocol.encode_for`). Kept apart because it is the protocol's versioning
policy, not its messages: every field or kind added within protocol 1 is listed here by the
feature that added it, and a sender leaves out what its peer's features do not list.

Why: an embedded broker outlives a ``pip install -U cpq``, and a rank runs the client's
interpreter, which may hold an older or newer cpq than its broker; each decoder refuses
fields it does not know (fail closed), so without this a newer rank could never report
ready to the older broker that spawned it. Every peer says which features it reads (a
broker in its groups' environment, :data:`FEATURES_ENV`, and in its welcome; a client in its
hello; a rank in ``rank_ready``). A new *value* of an enum-like field (``TaskResult.cause``,
``RankDone.stale_kind``) is a new feature too: an older decoder refuses values it does not
know, so such a value is never sent to a peer that does not list its feature.
"""

from __future__ import annotations

from typing import Any

FEATURES_ENV = "CPQ_BROKER_FEATURES"
#: Optional fields added within protocol 1, by the feature that added them: message kind ->
#: field names. ``a.b`` names field ``b`` of the record in field ``a`` (of each record, where
#: ``a`` is a list).
FEATURE_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "rank-memory": {"rank_ready": ("rss_mb",), "rank_done": ("cuda_mb", "cuda_reserved_mb")},
    "rank-unfit": {"rank_done": ("unfit",)},
    "task-env": {"submit": ("env",)},
    "code-freshness": {"rank_done": ("stale", "pg_seq")},
    "result-groups": {"done": ("result.groups",)},
    "task-affinity": {"submit": ("affinity",)},
    "env-delta": {"submit": ("env_same",), "run": ("env_same",), "rank_ready": ("features",)},
    "spawn-wait": {"done": ("result.spawn_wait_s",)},
    "task-retries": {"submit": ("retries",)},
    "pdb-relay": {"submit": ("debug_rank",), "run": ("debug",), "done": ("result.debug_rank",)},
    "import-env": {"rank_ready": ("bound_env",), "rank_done": ("bound_env", "stale_start")},
    "session-groups": {"submit": ("session", "own_groups")},
    "task-rng": {"submit": ("rng",), "run": ("rng",)},
    "rank-report": {"rank_done": ("result.report",), "done": ("result.ranks.report",)},
    "rank-pytest": {
        "rank_done": ("result.reports", "result.warnings"),
        "rank_stacks": ("phase",),
        "done": ("result.ranks.reports", "result.ranks.warnings", "result.phase"),
    },
    "task-coverage": {
        "submit": ("coverage",),
        "run": ("coverage",),
        "rank_done": ("coverage",),
        "done": ("result.coverage",),
    },
    # Typed contracts: the client tells a missed deadline, and the broker an import's
    # refusal, by these fields, never by the words of a message.
    "verdict-cause": {"done": ("result.cause",)},
    "refusal-kind": {"rank_done": ("stale_kind",)},
    # A rank refuses a task of a new caller when the last one left what it cannot put back
    # (stale_kind "state"); without it, the rank says "code" (the same fresh group).
    "state-refusal": {},
    # ``--cpq-confirm-fresh``: a task that runs only on a group started for it, and whether
    # a verdict's attempt ran on a group that had served no task before.
    "fresh-group": {"submit": ("fresh_group",), "done": ("result.on_fresh_group",)},
    # A rank's output so far, with its stack: a stuck rank's result shows what it printed.
    "stack-output": {"rank_stacks": ("stdout", "stderr")},
}
#: Message kinds added within protocol 1, by feature: never sent to a peer without it.
FEATURE_KINDS: dict[str, frozenset[str]] = {
    "task-waiting": frozenset({"waiting"}),
    "broker-closing": frozenset({"closing"}),
    "pdb-relay": frozenset({"debug_attach", "debug_line", "debug_output"}),
    "rank-pytest": frozenset({"rank_begun"}),
    "idle-stale": frozenset({"rank_stale"}),
}
ALL_FEATURES = frozenset(FEATURE_FIELDS) | frozenset(FEATURE_KINDS)


def reads_kind(kind: str, features: frozenset[str]) -> bool:
    """Whether a peer that reads ``features`` can decode a message of ``kind`` at all."""
    return all(kind not in kinds or feature in features for feature, kinds in FEATURE_KINDS.items())


def unread_fields(kind: str, features: frozenset[str]) -> list[str]:
    """The fields of a ``kind`` message a peer that reads ``features`` would refuse."""
    return [
        name
        for feature, kinds in FEATURE_FIELDS.items()
        if feature not in features
        for name in kinds.get(kind, ())
    ]


def drop(value: Any, path: list[str]) -> None:
    """Remove the field at ``path`` from a decoded map; a list on the way applies the rest
    of the path to each of its maps (``result.ranks.report``: every rank's ``report``)."""
    if isinstance(value, list):
        for item in value:
            drop(item, path)
    elif isinstance(value, dict):
        if len(path) == 1:
            value.pop(path[0], None)
        elif path[0] in value:
            drop(value[path[0]], path[1:])
