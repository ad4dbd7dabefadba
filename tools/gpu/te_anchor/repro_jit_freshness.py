"""Reproduction (CPU, no TE): a JIT cache file written during a task recycles the group.

Seen on the H200 pair (BENCHMARKS.md, "Transformer Engine's own CP test file"): on a
machine whose Triton and TorchInductor caches were empty, every cpq group that ran a TE
case compiling a kernel was stopped after that case with "code changed:
/root/.triton/cache/.../cuda_utils.cpython-312-x86_64-linux-gnu.so" or "code changed:
/tmp/torchinductor_root/.../<hash>.py", and its next task went to a fresh group (a
15-20 s spawn). Those files are generated code, content-addressed and written once; the
rank's code check (``cpq/rank/freshness.py``) watches every module in ``sys.modules``
outside the standard library and site-packages, and a file written while the task that
imported it ran "counts as changed at once". Two groups compiling the same kernel at the
same time trip it too (the second writer moves the file under the first).

This script does what Triton/Inductor do, in a few lines: the task writes a generated
module into a cache directory if it is not there yet, and imports it (registered in
``sys.modules``, as Inductor's code cache does). Expected: all three tasks on one group.
Seen before the fix (``cache_dirs`` in ``cpq/rank/freshness.py``): the second task ran on
a fresh group and the broker logged "code changed". ``--elsewhere`` writes the module into
a plain directory instead: code that changed while a task loaded it, still sent to a
fresh group (the exit status is then 1).

Usage (repo root; CPU, ws=1 gloo groups, ~20 s)::

    python tools/gpu/te_anchor/repro_jit_freshness.py [--elsewhere]
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def jit_task(cache_dir: str) -> dict[str, Any]:
    """Generate a module into ``cache_dir`` unless it is there (once per content hash), then
    import it, as Triton (``cuda_utils.so``) and TorchInductor (``<hash>.py``) do."""
    name = "generated_kernel_3f2a9c"
    path = os.path.join(cache_dir, name + ".py")
    if not os.path.exists(path):
        tmp = path + ".tmp"
        with open(tmp, "w") as out:
            out.write("VALUE = 42\n")
        os.replace(tmp, path)
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return {"pid": os.getpid(), "value": module.VALUE}


def main() -> int:
    sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
    from benchkit import PrivateBroker, child_env

    from cpq import Client

    work = Path(tempfile.mkdtemp(prefix="cpq-jit-repro-"))
    cache = work / "jit-cache"
    cache.mkdir()
    env = child_env(repo_first=False)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*paths, str(HERE)]))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    # Where TorchInductor would put it: the rank leaves compiler caches unwatched (fixed in
    # cpq/rank/freshness.py). With --elsewhere the module goes to a plain directory: code
    # written while a task loaded it, which still sends the next task to a fresh group.
    if "--elsewhere" not in sys.argv:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    (work / "state").mkdir()
    broker = PrivateBroker(work / "state", work / "logs", "none", env, ("--spares", "0"))
    groups = []
    try:
        with Client(broker.endpoint, name="jit-repro") as client:
            for i in range(3):
                result = client.submit(
                    "repro_jit_freshness:jit_task", 1, {"cache_dir": str(cache)}, timeout=60
                )
                groups.append(result.group_id)
                print(f"task {i + 1}: {result.outcome} on group {result.group_id}", flush=True)
    finally:
        broker.stop()
    log = (work / "logs" / "broker.log").read_text(errors="replace")
    changed = [line for line in log.splitlines() if "code changed" in line]
    print("\n".join(changed) or "(no 'code changed' in the broker log)")
    same = len(set(groups)) == 1
    print("expected one group for all three tasks:", "yes" if same else f"NO ({groups})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
