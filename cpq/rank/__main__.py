"""``torchrun ... -m cpq.rank``: one rank of a warm group (see :mod:`cpq.rank.runtime`)."""

from cpq.rank import importenv

importenv.install()  # before torch and the rest: every import from here on is seen

from cpq.rank.runtime import main  # noqa: E402

main()
