"""``python -m cpq.caller PLAN``: the warm caller's process (:mod:`cpq.caller.server`)."""

from cpq.caller import descriptors

descriptors.reserve()  # before anything opens one: the numbers a caller's descriptors take

from cpq.rank import importenv  # noqa: E402

importenv.install()  # first: what every later import reads is checked against each caller

import sys  # noqa: E402

from cpq.caller.server import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
