"""Targets named by unit tests (never imported by a broker; it only checks the syntax)."""


def noop() -> None:
    pass
