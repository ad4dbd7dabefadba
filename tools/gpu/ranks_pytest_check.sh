#!/usr/bin/env bash
# Issue 27 on the H200 host: a small nccl suite written for `torchrun -m pytest` (conftest
# initialises the default group, tests use CUDA tensors, tmp_path, a module fixture, an
# unbroadcast randn, a skipif on WORLD_SIZE) gives the same verdict per test under
# `pytest --cpq-world-size N` (cold, then warm) as under `torchrun --nproc-per-node N -m
# pytest`, N = the GPUs the host has (at most 2). Prints one line per session.
# Usage (repo root, on the GPU host, .whl carried):  tools/gpu/ranks_pytest_check.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
n=$(python3 -c "import torch; print(min(2, torch.cuda.device_count()))")
p=$(mktemp -d); cd "$p" || exit 1
cat > conftest.py <<'PY'
import os, pytest, torch, torch.distributed as dist
@pytest.fixture(scope="session", autouse=True)
def pg():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    yield
    dist.destroy_process_group()
PY
cat > test_gpu.py <<'PY'
import os, pytest, torch, torch.distributed as dist
@pytest.fixture(scope="module")
def ones():
    return torch.ones(4, device="cuda")
def test_all_reduce(ones):
    t = ones.clone(); dist.all_reduce(t); assert t.sum().item() == 4 * dist.get_world_size()
def test_tmp_path(tmp_path):
    (tmp_path / "x").write_text("1"); assert (tmp_path / "x").exists()
def test_unbroadcast_randn():
    w = torch.randn(4, device="cuda"); g = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(g, w); assert all(torch.equal(g[0], x) for x in g)
@pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) < 2, reason="two ranks")
def test_two_ranks():
    assert dist.get_world_size() == 2
def test_fails():
    assert torch.zeros(1, device="cuda").item() == 1
PY
run() { python3 -m pytest -p cpq.client.plugin -q -rA -p no:cacheprovider "$@" 2>&1 | grep -E "^(PASSED|FAILED|SKIPPED|ERROR)" | sed 's/ - .*//' | sort -u | tr '\n' ' '; echo; }
echo "ref:  $(python3 -m torch.distributed.run --nproc-per-node "$n" -m pytest -q -rA -p no:cacheprovider 2>&1 | grep -E "^(PASSED|FAILED|SKIPPED|ERROR)" | sed 's/ - .*//' | sort -u | tr '\n' ' ')"
echo "cold: $(run --cpq-world-size "$n")"
echo "warm: $(run --cpq-world-size "$n")"
python3 -m cpq stop >/dev/null 2>&1
echo "n=$n"
