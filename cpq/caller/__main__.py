"""``python -m cpq.caller PLAN``: the warm caller's process (:mod:`cpq.caller.server`)."""

from cpq.rank import importenv

importenv.install()  # first: what every later import reads is checked against each caller

import sys  # noqa: E402

from cpq.caller.server import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
