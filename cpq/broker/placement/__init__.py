"""Placement: which group runs a task, which group starts or stops, on which GPUs.

One pure function of a :class:`~.view.Snapshot` (queued tasks by spec and age, the groups
and their states, the node's GPUs, cores and memory, the GPU leases and wants of other
brokers, spawn and affinity history) to a list of decisions (:mod:`.decisions`: run task T
on group G; start a group of spec S on GPUs X; stop G and why; yield G to another broker;
want GPUs from them) that the broker carries out in order (:mod:`cpq.broker.placing`).
Nothing here reads a clock, a socket or a file, so placement is tested as a table of
snapshots and by properties over random ones (``tests/unit/test_placement.py``).

The steps, each a module with one ``step(plan)``, run in this order
(:mod:`.steps`) on one :class:`~.plan.Plan` (the snapshot as the decisions so far leave it)::

    recycling  -> affinity -> growth (eviction) -> yielding -> spares -> warming
    stop idle     queued      start for queued     idle GPU     one clean   groups asked
    groups past   tasks onto  tasks, making room   groups to    group per   for ahead of
    their bounds  idle groups or wanting GPUs      older wants  used spec   tasks

Admission (:mod:`.admission`) is the gate before all of them: a spec the room can never
hold is refused at submit and never queued. A step reads the snapshot and the plan; it
writes only decisions, through the plan (no step reads state another step left behind
as a side effect). The budget the steps share is :mod:`.plan`'s: GPUs are disjoint; a CPU
group costs memory while it lives and cores while it runs a task. docs/design.md,
"Placement", has the picture.
"""
