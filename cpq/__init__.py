"""cpq: warm torchrun worker groups, shared by every test process on a node.

The names below are handed on lazily (PEP 562): ``import cpq.broker.loop`` or
``python -m cpq.rank`` imports this package first, and must not load the client's code
(docs/design.md "Module map"). ``from cpq import Client`` loads the client then.

PYTEST_DONT_REWRITE: cpq's asserts are its own, not a test's. A session the warm caller
hands over has this package loaded before pytest marks the plugins' packages for assertion
rewriting, which would warn there ("already imported") and not in a fresh process where
the install lists the package's files (an ``egg-info`` beside the source).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "BadRequest": "cpq.specs",
    "BrokerUnavailable": "cpq.client.api",
    "Client": "cpq.client.api",
    "EncodeError": "cpq.protocol",
    "PoolSpec": "cpq.protocol",
    "RankError": "cpq.protocol",
    "RankResult": "cpq.protocol",
    "TaskResult": "cpq.protocol",
    "register_reset_hook": "cpq.rank.reset",
}

__all__ = [
    "BadRequest",
    "BrokerUnavailable",
    "Client",
    "EncodeError",
    "PoolSpec",
    "RankError",
    "RankResult",
    "TaskResult",
    "__version__",
    "register_reset_hook",
]

if TYPE_CHECKING:
    from cpq.client.api import BrokerUnavailable, Client
    from cpq.protocol import EncodeError, PoolSpec, RankError, RankResult, TaskResult
    from cpq.rank.reset import register_reset_hook
    from cpq.specs import BadRequest


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cpq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value
