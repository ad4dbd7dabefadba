"""``python -m cpq.broker``: the broker's command line (:mod:`cpq.broker.cli`)."""

import sys

from cpq.broker.cli import broker_main

sys.exit(broker_main(prog="python -m cpq.broker"))
