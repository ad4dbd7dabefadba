"""``python -m cpq``: the ``cpq`` command (see ``python -m cpq --help``)."""

import sys

from cpq.client.cli import main

sys.exit(main())
