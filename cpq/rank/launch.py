"""``python -m cpq.rank.launch <torchrun args>``: torchrun that dies with the broker.

The broker starts every group through this shim rather than the ``torchrun`` script so the
agent process carries a parent-death signal; ``preexec_fn`` would do the same but is unsafe
in a process that has ZeroMQ's I/O threads running. It also passes the group's GPU lease
descriptors on to every rank (:mod:`cpq.rank.leases`).
"""

from __future__ import annotations

import sys

from cpq.osutil import die_with_parent
from cpq.rank import leases


def main() -> None:
    die_with_parent()
    leases.pass_to_ranks()  # the ranks hold the group's GPU leases too
    from torch.distributed.run import main as torchrun_main

    torchrun_main(sys.argv[1:])


if __name__ == "__main__":
    main()
