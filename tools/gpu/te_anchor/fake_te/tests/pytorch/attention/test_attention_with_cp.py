"""CPU stand-in for TE's ``test_attention_with_cp.py``: the same pool client, tiny matrix.

``PoolWorker`` is a reduced copy of the shape of TE's (spawn a ``torchrun`` of the pool
script under ``$TE_PATH``, one JSON line in, one out, ``AssertionError`` with the rank's
traceback on failure, a session fixture ``cp_pool``, ``_submit`` sending string kwargs),
so ``te_anchor_cpq`` patches it exactly as it patches TE's.
"""

import json
import os
import select
import subprocess
import sys
import threading

import pytest

POOL_SUBMIT_TIMEOUT_SEC = float(os.getenv("NVTE_CP_POOL_TIMEOUT_SEC", "90"))


class PoolWorker:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.proc = None

    def _spawn(self) -> None:
        worker = os.path.join(
            os.environ["TE_PATH"], "tests/pytorch/attention/run_attention_with_cp_pool.py"
        )
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        cmd += [f"--nproc-per-node={self.world_size}", "--standalone", worker]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, ""):
            sys.stderr.write(line)
            sys.stderr.flush()

    def submit(self, kwargs: dict, timeout: float = POOL_SUBMIT_TIMEOUT_SEC) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._spawn()
        self.proc.stdin.write(json.dumps({"op": "run", "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"pool worker timed out after {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError("pool worker died mid-request")
        resp = json.loads(line)
        if not resp["ok"]:
            raise AssertionError(resp["error"])

    def shutdown(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
            self.proc.stdin.flush()
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="session")
def cp_pool():
    pools = {}

    def _get(world_size):
        if world_size not in pools:
            pools[world_size] = PoolWorker(world_size)
        return pools[world_size]

    yield _get
    for pool in pools.values():
        pool.shutdown()


def _submit(pool, **kwargs):
    pool.submit({k: str(v) for k, v in kwargs.items()})


@pytest.mark.parametrize("dtype", ["bf16"])
@pytest.mark.parametrize("model", ["cp_a", "cp_b", "cp_bad"])
@pytest.mark.parametrize("qkv_format", ["sbhd", "thd"])
@pytest.mark.parametrize("cp_comm_type", ["p2p", "a2a"])
def test_cp_with_fused_attention(cp_pool, dtype, model, qkv_format, cp_comm_type):
    pool = cp_pool(2)
    if qkv_format == "thd" and cp_comm_type == "a2a":
        pytest.skip("No support for THD format with cp_comm_type=a2a (stand-in rule)!")
    _submit(
        pool,
        dtype=dtype,
        model=model,
        qkv_format=qkv_format,
        kernel_backend="FusedAttention",
        cp_comm_type=cp_comm_type,
        log_level="WARNING",
    )
