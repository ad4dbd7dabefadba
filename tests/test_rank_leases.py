"""The torchrun agent passes a group's GPU lease descriptors on to every rank it starts,
whichever way its torch version calls ``Popen`` (cpq/rank/leases.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT

AGENT = """
import os, subprocess, sys
lease = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
info = os.fstat(lease)
os.environ["CPQ_LEASE_FDS"] = f"{lease}:{info.st_dev}:{info.st_ino}"
from cpq.rank import leases
leases.pass_to_ranks()
child = "import os, sys; os.fstat(int(sys.argv[1])); print('held')"
# as torch versions that call subprocess.Popen do, and as those that imported Popen by name
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
for popen in (subprocess.Popen, getattr(subprocess_handler, "Popen", subprocess.Popen)):
    proc = popen([sys.executable, "-c", child, str(lease)], close_fds=True,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    print(out.strip() or err.strip().splitlines()[-1])
"""


def test_every_worker_popen_inherits_the_lease_descriptors(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", AGENT, str(tmp_path / "GPU-x.lease")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["held", "held"], done.stdout + done.stderr
