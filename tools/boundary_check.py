"""The session boundary against fresh runs: one session leaves something, the next expects a
new process's state (docs/design.md, "The session boundary").

For each row, two pytest sessions run one after the other — ``test_first.py``, then
``test_next.py`` — once as fresh ``torchrun --standalone --nproc-per-node 1 -m pytest`` runs
(the reference) and once as ``pytest --cpq-world-size 1`` sessions on one broker (the one
``CPQ_ENDPOINT`` names, else the default), and their verdicts are compared.

Rows: ``flags`` (torch's switches), ``module`` (a list in the project's own module),
``memory`` (GPU: a library's global keeps most of the GPU's memory; the next session needs
it), ``assert`` (GPU: a device-side assert, a sticky CUDA error). ``--rows`` picks; the GPU
rows are skipped without CUDA. Prints a table; ``--json OUT`` writes the rows.

Usage: python tools/boundary_check.py [--rows flags,module] [--json OUT] [--keep DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

ROWS: dict[str, dict[str, str]] = {
    "flags": {
        "test_first.py": """
            import torch

            def test_sets_switches():
                torch.set_default_dtype(torch.float64)
                torch.use_deterministic_algorithms(True, warn_only=True)
                torch.set_float32_matmul_precision("medium")
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.benchmark = True
            """,
        "test_next.py": """
            import torch

            def test_expects_torchs_defaults():
                assert torch.get_default_dtype() == torch.float32
                assert not torch.are_deterministic_algorithms_enabled()
                assert torch.get_float32_matmul_precision() == "highest"
                assert not torch.backends.cuda.matmul.allow_tf32
                assert not torch.backends.cudnn.benchmark
            """,
    },
    "module": {
        "boundary_lib.py": "STATE = []\n",
        "test_first.py": """
            import boundary_lib

            def test_appends():
                boundary_lib.STATE.append(1)
                assert boundary_lib.STATE == [1]
            """,
        "test_next.py": """
            import boundary_lib

            def test_expects_it_empty():
                assert boundary_lib.STATE == []
            """,
    },
    "memory": {
        "test_first.py": """
            import torch
            import torch.nn

            def test_a_library_global_keeps_memory():
                free, total = torch.cuda.mem_get_info()
                keep = torch.empty(int(free * 0.7), dtype=torch.uint8, device="cuda")
                torch.nn._kept_by_a_test = keep
            """,
        "test_next.py": """
            import torch

            def test_needs_the_memory():
                free, total = torch.cuda.mem_get_info()
                big = torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
                assert big.numel() > 0
            """,
    },
    "assert": {
        "test_first.py": """
            import torch

            def test_device_side_assert():
                x = torch.zeros(4, device="cuda")
                index = torch.tensor([10], device="cuda")
                y = x[index]
                torch.cuda.synchronize()
            """,
        "test_next.py": """
            import torch

            def test_uses_cuda():
                assert torch.ones(2, device="cuda").sum().item() == 2.0
            """,
    },
}
GPU_ROWS = ("memory", "assert")


def verdict(xml: Path) -> str:
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return "no result"
    out = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None:
            out.append("failed")
        elif case.find("error") is not None:
            out.append("error")
        elif case.find("skipped") is not None:
            out.append("skipped")
        else:
            out.append("passed")
    return "+".join(out) or "no test"


def run(args: list[str], cwd: Path, xml: Path) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [*args, "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--junitxml={xml}"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return verdict(xml), done.stdout + done.stderr


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="make the projects here (kept)")
    options = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    base = options.keep or Path(tempfile.mkdtemp(prefix="cpq-boundary-"))
    fresh = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    fresh += ["-m", "pytest", "-p", "no:cpq"]
    cpq = [sys.executable, "-m", "pytest", "--cpq-world-size", "1"]
    try:
        importlib.metadata.distribution("cpq")
    except importlib.metadata.PackageNotFoundError:  # cpq on PYTHONPATH only (a GPU host)
        cpq[3:3] = ["-p", "cpq.client.plugin"]
    results = []
    for row in options.rows.split(","):
        if row in GPU_ROWS and not cuda:
            print(f"{row:8} skipped: no CUDA")
            continue
        project = base / row
        project.mkdir(parents=True, exist_ok=True)
        for name, text in ROWS[row].items():
            (project / name).write_text(textwrap.dedent(text))
        got: dict[str, list[str]] = {}
        outputs: dict[str, str] = {}
        for how, command in (("fresh", fresh), ("cpq", cpq)):
            got[how] = []
            for session in ("test_first.py", "test_next.py"):
                xml = project / f"{how}-{session}.xml"
                outcome, output = run([*command, session], project, xml)
                got[how].append(outcome)
                outputs[f"{how}-{session}"] = output
        first_output = outputs["cpq-test_first.py"]
        results.append(
            {
                "row": row,
                "fresh": got["fresh"],
                "cpq": got["cpq"],
                "same": got["fresh"] == got["cpq"],
                # a failing first test is reported from its own frames, not cpq's
                "own_frames": "cpq/rank" not in first_output,
            }
        )
        r = results[-1]
        print(
            f"{row:8} fresh {'/'.join(r['fresh']):15} cpq {'/'.join(r['cpq']):15} "
            f"{'same' if r['same'] else 'DIFFERENT'}"
            + ("" if r["own_frames"] else "  (cpq's frames in the first report)")
        )
    if options.json:
        options.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["same"] and r["own_frames"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
