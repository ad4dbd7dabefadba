"""The cpq-broker process: one event loop between clients and the ranks of warm groups.

Modules (see ``docs/design.md``, "Module map"):

* :mod:`~cpq.broker.loop` — the :class:`~cpq.broker.loop.Broker`: polls both sockets,
  dispatches messages through handler tables keyed by message class, ticks, and is the only
  place that coordinates the pools and the task lifecycle;
* :mod:`~cpq.broker.transport` — the endpoint lock, the two ROUTER sockets, sending;
* :mod:`~cpq.broker.pools` — groups, ranks and resources;
* :mod:`~cpq.broker.tasks` — a task's life from submit to verdict;
* :mod:`~cpq.broker.model`, :mod:`~cpq.broker.config`, :mod:`~cpq.broker.clock` — data;
* :mod:`~cpq.broker.scheduler`, :mod:`~cpq.broker.supervisor`, :mod:`~cpq.broker.liveness`,
  :mod:`~cpq.broker.history`, :mod:`~cpq.broker.snapshot`, :mod:`~cpq.broker.logfile`.

Kept free of imports so that importing one module (say, the log handler) does not load the
whole broker.
"""
