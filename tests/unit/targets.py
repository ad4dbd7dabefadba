"""Targets named by unit tests (never imported by a broker; it only checks the syntax)."""


def noop() -> None:
    pass


SEEDS: list[int] = []


def record_seed(seed: int) -> None:
    """A reset hook named in ``CPQ_RESET_HOOKS`` by tests/unit/test_reset.py."""
    SEEDS.append(seed)
