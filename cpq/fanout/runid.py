"""Which CI run a shard belongs to: the id every manifest carries and ``cpq merge`` checks.

Why a run identity: a results directory is often reused (a fixed shared path, a CI cache),
and a shard that is cancelled before it writes leaves the previous run's manifest in
place. Without an id the merge would take that stale file as this run's shard and could
call a run green whose tests never ran. The id comes from the scheduler where it has one,
so every shard of a run agrees on it without talking to the others:

* ``CPQ_RUN_ID`` when set (the templates set it; a rerun of one shard sets the run's id);
* a Slurm array's job id (``SLURM_ARRAY_JOB_ID``, the same in every task of the array);
* GitHub Actions' run id and attempt (``GITHUB_RUN_ID``, ``GITHUB_RUN_ATTEMPT``);
* otherwise a fresh random id, which the shard prints: shards started by hand must then be
  given one ``CPQ_RUN_ID`` to be merged together.

Kubernetes puts no Job id in a pod's environment: the Indexed Job template maps the Job's
uid (its ``batch.kubernetes.io/controller-uid`` label) into ``CPQ_RUN_ID`` through the
downward API.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

RUN_ID_VAR = "CPQ_RUN_ID"


def from_env(env: Mapping[str, str]) -> tuple[str, str]:
    """``(run id, where it came from)``; the source is ``"random"`` for a fresh id."""
    if env.get(RUN_ID_VAR):
        return env[RUN_ID_VAR], RUN_ID_VAR
    if env.get("SLURM_ARRAY_JOB_ID"):
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}", "SLURM_ARRAY_JOB_ID"
    if env.get("GITHUB_RUN_ID"):
        attempt = env.get("GITHUB_RUN_ATTEMPT") or "1"
        return f"github-{env['GITHUB_RUN_ID']}-{attempt}", "GITHUB_RUN_ID"
    return f"local-{secrets.token_hex(6)}", "random"
