"""cpq: warm torchrun worker groups, shared by every test process on a node."""

from __future__ import annotations

__version__ = "0.1.0"

from cpq.client import BadRequest, BrokerUnavailable, Client
from cpq.protocol import EncodeError, PoolSpec, RankError, RankResult, TaskResult
from cpq.rank.reset import register_reset_hook

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
