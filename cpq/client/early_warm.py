"""The last session's groups, asked for before this session's conftests import anything.

Why: a pytest process whose root conftest imports the world (Megatron-LM's imports torch and
``megatron.core``: 13-15 s on the H200 host) used to ask for its group at
``pytest_sessionstart``, after those imports; a broker that had idled out (or a CI job's new
one) then started the group (~7.5 s there) while the session already waited. The plugin is
imported before any conftest (an entry point, or ``-p``), so at
``pytest_load_initial_conftests`` (first of its implementations) it reads what the last
session of this project needed from pytest's cache — the same entry the session-start
warm-up reads, written after collection — and asks for those groups now: the spawn overlaps
the conftests' imports.

It asks only for what cannot be wrong for long: a cached spec whose roots and interpreter
are this process's and whose start variables agree with every start variable the shell sets
now (a conftest's ``pytest_configure`` may add more, as Megatron-LM's sets ``NCCL_*`` ones:
the cache holds them, since it was written after configure). A spec that turns out not to
be this session's stays an idle group the placement evicts when room is needed. It sends
nothing where the session-start warm-up would not, nor where no test runs: under
``--collect-only``, ``--help``, ``--fixtures`` or ``--markers``, in a shard, under a
launcher, without the cache plugin, with an empty or unreadable cache. An xdist worker asks
too (it cannot tell itself from a pytest run by a test under xdist, which inherits
``PYTEST_XDIST_WORKER``): the same request as its controller's, and warming starts a spec's
groups up to the count asked for, not once per request. Everything here is best effort: an
error is swallowed and the session-start warm-up and the tests go on as before
(docs/design.md, "The calling process's floor").
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from cpq import protocol
from cpq.protocol import PoolSpec

#: The pytest cache key the plugin writes after collection (specs and counts).
WARM_CACHE_KEY = "cpq/warm-specs"


def cached_specs(recorded: Any, here: PoolSpec) -> tuple[list[PoolSpec], list[int]]:
    """The specs (and counts) of a cache entry that fit a process whose own spec at world
    size 1 is ``here``: same roots and interpreter, and every start variable ``here`` has
    set to the same value. Nothing for an entry of another shape (another cpq version)."""
    specs: list[PoolSpec] = []
    counts: list[int] = []
    if not isinstance(recorded, list):
        return specs, counts
    for entry in recorded:
        try:
            spec = protocol.from_wire(PoolSpec, entry["spec"])
            count = int(entry["count"])
        except (protocol.ProtocolError, KeyError, TypeError, ValueError):
            return [], []
        cached_env = dict(spec.env)
        same_env = all(cached_env.get(k) == v for k, v in here.env)
        if spec.roots == here.roots and spec.python == here.python and same_env:
            specs.append(spec)
            counts.append(count)
    return specs, counts


def send(config: pytest.Config) -> bool:
    """Ask the broker for the groups the last session needed; True when it was asked."""
    try:
        if not _may_send(config):
            return False
        recorded = _read_cache(config)
        if not recorded:
            return False
        from cpq.client import session as client_session

        here = client_session.spec_of(config, 1)
        specs, counts = cached_specs(recorded, here)
        if not specs:
            return False
        options = config.known_args_namespace  # config.option holds defaults until configure
        endpoint = client_session.endpoint_of(config, options)
        if client_session.autostart_of(config, options) and endpoint.startswith("ipc://"):
            from cpq.client.autostart import ensure_broker

            ensure_broker(endpoint)
        from cpq.client.api import Client

        client = Client(endpoint, name="pytest-early-warm")
        try:
            client.warm(specs, counts)
            # Answered after the warm-up was handled (one connection keeps its order): the
            # close that follows drops what is unsent, and the warm-up is then no longer so.
            client.status()
        finally:
            client.close()
        return True
    except Exception:  # an optimisation only: the session-start warm-up asks again
        return False


#: pytest's options under which a session runs no test (their ``dest`` names).
_RUNS_NO_TEST = (
    "collectonly",
    "help",
    "version",
    "showfixtures",
    "show_fixtures_per_test",
    "markers",
)


def runs_no_test(options: Any) -> bool:
    """Whether pytest's options (``config.option``, or the namespace parsed before the
    conftests) ask for a run that runs no test: no group is worth starting for it."""
    return any(getattr(options, name, False) for name in _RUNS_NO_TEST)


def _may_send(config: pytest.Config) -> bool:
    if "RANK" in os.environ and ("TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ):
        return False  # under a launcher cpq steps aside
    if config.pluginmanager.is_blocked("cacheprovider"):
        return False
    if runs_no_test(config.known_args_namespace):
        return False  # no broker started for `pytest --help`
    return not _is_shard(config)


def _is_shard(config: pytest.Config) -> bool:
    """A shard keeps part of what it collects: the last run's groups may be another
    share's. An option or variable that does not parse counts as a shard (the fan-out
    plugin says what is wrong with it at configure)."""
    from cpq.fanout.shard import ShardError, parse_shard, shard_from_env

    option = getattr(config.known_args_namespace, "cpq_shard", None)
    try:
        if option is not None:
            return option.strip().lower() != "off" and parse_shard(option) is not None
        return shard_from_env(os.environ) is not None
    except ShardError:
        return True


def _read_cache(config: pytest.Config) -> Any:
    """The cache entry, read as the cache plugin will at configure (same directory rules:
    ``cache_dir`` under the rootdir, ``--cache-clear`` honoured by that plugin first)."""
    if getattr(config.known_args_namespace, "cacheclear", False):
        return None
    from _pytest.cacheprovider import Cache

    cache = Cache.for_config(config, _ispytest=True)
    return cache.get(WARM_CACHE_KEY, None)
