"""``torchrun ... -m cpq.rank``: one rank of a warm group (see :mod:`cpq.rank.runtime`)."""

from cpq.rank.runtime import main

main()
