"""The context-parallel attention suite, as a user would port it: one marker per test.

Every case builds Q/K/V from one seed on each rank, runs one CP scheme (all_gather, p2p,
a2a) over the load-balanced sequence split on a warm ws=2 gloo group, and compares out,
dq, dk, dv with the non-CP reference; ``broken=True`` proves a wrong scheme is caught.
"""

from __future__ import annotations

from typing import Any

import pytest

from workers.cp_attention import CASES, case_id, run_cp_attention


@pytest.mark.cpq(world_size=2)
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_cp_attention(case: dict[str, Any]) -> None:
    errors = run_cp_attention(**case)  # raises AssertionError naming any tensor off tolerance
    assert errors["world_size"] == 2


@pytest.mark.cpq(world_size=2)
@pytest.mark.parametrize("scheme", ["all_gather", "p2p", "a2a"])
def test_broken_scheme_is_caught(scheme: str) -> None:
    with pytest.raises(AssertionError, match="max abs err"):
        run_cp_attention(cp_comm_type=scheme, attn_mask="causal", broken=True)
