"""What runs under torchrun: every rank of a warm group (``python -m cpq.rank``).

* :mod:`~cpq.rank.launch` — ``python -m cpq.rank.launch``: torchrun that dies with the broker;
* :mod:`~cpq.rank.io` — the link to the broker: one DEALER, main thread and watchdog take turns;
* :mod:`~cpq.rank.runtime` — the main thread's task loop;
* :mod:`~cpq.rank.reset`, :mod:`~cpq.rank.capture` — state reset and output capture per task;
* :mod:`~cpq.rank.pytest_task` — the target the pytest plugin sends.

Imports nothing of :mod:`cpq.broker`: only :mod:`cpq.protocol` (and :mod:`cpq.osutil`) is
shared with it.
"""
