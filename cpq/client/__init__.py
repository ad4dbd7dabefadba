"""The client process: ``cpq.Client``, its socket, autostart, the pytest plugin, the CLIs.

Nothing in the broker or the ranks imports this folder (docs/design.md "Module map").
"""

from __future__ import annotations

from cpq.client.api import BrokerUnavailable, Client, caller_environ
from cpq.specs import BadRequest, default_roots, interpreter, make_spec

__all__ = [
    "BadRequest",
    "BrokerUnavailable",
    "Client",
    "caller_environ",
    "default_roots",
    "interpreter",
    "make_spec",
]
