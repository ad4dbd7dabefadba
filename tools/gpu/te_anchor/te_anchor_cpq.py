"""pytest plugin: run Transformer Engine's own CP test file with its cases sent to cpq.

TE's ``tests/pytorch/attention/test_attention_with_cp.py`` hands every case to its own
stdio pool: ``_submit(pool, **kwargs)`` calls ``PoolWorker.submit({k: str(v)})``, which
writes one JSON line to a long-lived ``torchrun`` (``run_attention_with_cp_pool.py``) and
reads one back. This plugin changes exactly one thing: ``PoolWorker.submit`` of the
collected test module sends the same kwargs to a cpq broker instead, as the task
``te_anchor_rank:run_case`` (TE's ``run_dpa_with_cp(**kwargs)`` on every rank of a warm
group) with ``NVTE_CP_POOL_PG=1``. Collection, parametrisation, skips, backend checks and
the case itself are TE's, unchanged; TE's pool is simply never spawned.

Verdicts map as TE's pool maps them: a passed task returns, a failed one raises
``AssertionError`` with the first failing rank's traceback (TE's pool sends the same);
an infra error (which cpq already retried once on a fresh group) raises too, naming it.

Use (the broker's endpoint from ``CPQ_ENDPOINT``, as for any cpq client)::

    export PYTHONPATH=<repo>:<repo>/tools/gpu/te_anchor TE_PATH=<repo>/.te-tests
    cd $TE_PATH && python -m pytest -p te_anchor_cpq \\
        tests/pytorch/attention/test_attention_with_cp.py

Environment (all optional):

* ``TE_ANCHOR_AFFINITY`` — ``case`` (default): the affinity key is the case's kwargs, so
  with several idle groups a case goes back to the group that ran it (its cuDNN plans are
  built there); ``none``: no key (the broker then picks the most recently used group);
  any other value is used as the key itself.
* ``TE_ANCHOR_WARM`` — groups to ask for at session start, before collection imports TE
  (default 1; 0: none), as cpq's own plugin warms up during collection.
* ``TE_ANCHOR_LOG`` — append one JSON line per case (group, times) to this file.
* ``TE_ANCHOR_TIMEOUT`` — per-case deadline in seconds (default: TE's own
  ``NVTE_CP_POOL_TIMEOUT_SEC``, 90).
* ``TE_ANCHOR_PRELOAD`` — the group's ``CPQ_PRELOAD`` (default ``transformer_engine.pytorch``;
  empty: none).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest

TARGET = "te_anchor_rank:run_case"
_lock = threading.Lock()
_client: Any = None
_patched: set[int] = set()


def _group_env() -> dict[str, str]:
    preload = os.environ.get("TE_ANCHOR_PRELOAD", "transformer_engine.pytorch")
    return {"CPQ_PRELOAD": preload} if preload else {}


def _get_client() -> Any:
    global _client
    with _lock:
        if _client is None:
            from cpq import Client

            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            _client = Client(name=f"te-anchor-{worker}")
        return _client


def affinity_key(kwargs: dict[str, str]) -> str:
    """The case's affinity key (see ``TE_ANCHOR_AFFINITY``)."""
    mode = os.environ.get("TE_ANCHOR_AFFINITY", "case")
    if mode == "none":
        return ""
    if mode != "case":
        return mode
    return "te-cp:" + ",".join(f"{k}={kwargs[k]}" for k in sorted(kwargs) if k != "log_level")


def _timeout() -> float:
    default = os.environ.get("NVTE_CP_POOL_TIMEOUT_SEC", "90")
    return float(os.environ.get("TE_ANCHOR_TIMEOUT", default))


def _log(record: dict[str, Any]) -> None:
    path = os.environ.get("TE_ANCHOR_LOG")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def _failure_text(result: Any) -> str:
    """What TE's pool would raise: the first failing rank's traceback (plus cpq's notes)."""
    parts = [f"[cpq {result.outcome}] {result.message}".rstrip()]
    parts += list(result.notes)
    for rank in result.failed_ranks:
        if rank.error is not None:
            parts.append(f"[Rank {rank.rank}] {rank.error.traceback or rank.error.message}")
            break
    return "\n".join(p for p in parts if p)


def cpq_submit(self: Any, kwargs: dict, timeout: float | None = None) -> None:
    """``PoolWorker.submit`` replaced: the case goes to cpq, the verdict comes back."""
    os.environ["NVTE_CP_POOL_PG"] = "1"  # a task variable: applied on every rank
    key = affinity_key(kwargs)
    test_id = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    start = time.perf_counter()
    result = _get_client().submit(
        TARGET,
        self.world_size,
        {"kwargs": dict(kwargs)},
        timeout=_timeout() if timeout is None else timeout,
        env=_group_env(),
        test_id=test_id,
        affinity=key,
    )
    rtt = time.perf_counter() - start
    value = result.value if isinstance(result.value, dict) else {}
    _log(
        {
            "test": test_id,
            "outcome": result.outcome,
            "group": result.group_id,
            "groups": list(result.groups),
            "attempts": result.attempts,
            "rtt_s": round(rtt, 4),
            "queue_s": round(result.queue_s, 4),
            "duration_s": round(result.duration_s, 4),
            "case_s": value.get("case_s"),
            "affinity": key,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "end": time.time(),
        }
    )
    if result.outcome == "passed":
        return
    if result.outcome == "skipped":
        pytest.skip(result.message)
    raise AssertionError(_failure_text(result))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Ask for warm groups now, while collection imports TE (cpq's plugin does the same)."""
    count = int(os.environ.get("TE_ANCHOR_WARM", "1"))
    if count <= 0:
        return
    from cpq.specs import make_spec

    spec = make_spec(int(os.environ.get("TE_ANCHOR_WS", "2")), _group_env())
    _get_client().warm([spec], [count])


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Swap ``PoolWorker.submit`` in every collected module that has TE's pool class."""
    for item in items:
        module = getattr(item, "module", None)
        worker_cls = getattr(module, "PoolWorker", None)
        if worker_cls is None or id(worker_cls) in _patched:
            continue
        worker_cls.submit = cpq_submit
        _patched.add(id(worker_cls))


def pytest_unconfigure(config: pytest.Config) -> None:
    global _client
    with _lock:
        if _client is not None:
            _client.close()
            _client = None
