"""Starting groups before tasks need them: ``cpq-broker --warm`` and the plugin's warm-up.

A warmed group only serves tasks whose spec is equal, roots, interpreter and start
variables included (see ``cpq-broker --help`` on ``--warm-root``); a mismatch leaves it
idle, never wrong. Warming never evicts: it fills free room only.
"""

from __future__ import annotations

import logging

from cpq.broker.pools import Pools
from cpq.protocol import PoolSpec

log = logging.getLogger("cpq.broker")


def start(pools: Pools, wanted: list[tuple[PoolSpec, int]], quiet: bool) -> None:
    """Bring each spec up to its wanted number of live groups, as room allows.

    ``quiet``: a client's request (its impossible specs are refused when it submits);
    otherwise the operator's ``--warm``, whose problems are logged.
    """
    for spec, count in wanted:
        impossible = pools.resources.impossible(spec)
        if impossible:
            if not quiet:
                log.warning("--warm %s: %s", spec.label(), impossible)
            continue
        have = len(pools.live(spec)) if quiet else 0
        for started in range(max(0, count - have)):
            if pools.start(spec) is None:
                if not quiet:
                    log.warning(
                        "--warm %s: room for %d of %d groups only", spec.label(), started, count
                    )
                break
