#!/usr/bin/env bash
# The test command: install what is missing, then run cpq's whole test suite.
#
#   tools/test.sh            # what README's quickstart calls "the tests"
#   tools/test.sh --static   # also ruff and mypy first (.ci/run: exactly this)
#   tools/test.sh -- -k fidelity    # arguments after -- go to pytest
#
# Installs: cpq with its test extra (pinning torch==2.13.0, the version CI tests with; set
# CPQ_TORCH= to keep yours), and,
# where missing and this runs as root, the Debian packages the end-to-end tests drive for
# real: Slurm (tests/fanout: two slurmd on this host), shellcheck (the CI templates' scripts),
# headless Chromium (the timeline page); and two system users whose brokers the GPU lease
# tests start. Without root they are skipped with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."

static=0
pytest_args=()
while (($#)); do
    case "$1" in
        --static) static=1 ;;
        --) shift; pytest_args+=("$@"); break ;;
        *) pytest_args+=("$1") ;;
    esac
    shift
done

# CPQ_TORCH= (empty) keeps the torch you have (a GPU node's CUDA build)
# shellcheck disable=SC2086  # an empty pin expands to nothing
python -m pip install -q ${CPQ_TORCH-torch==2.13.0} -e '.[test]'

missing=()
command -v sbatch >/dev/null || missing+=(slurmctld slurmd slurm-client munge)
command -v shellcheck >/dev/null || missing+=(shellcheck)
command -v chromium >/dev/null || missing+=(chromium fonts-dejavu-core)
if ((${#missing[@]})); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
    else
        echo "tools/test.sh: not installing ${missing[*]} (needs root and apt-get);" \
            "the tests that drive them are skipped" >&2
    fi
fi

# Brokers of other users for the GPU lease tests (tests/test_gpu_leases.py), as root only.
if [[ $(id -u) == 0 ]]; then
    for user in cpq-lease-a cpq-lease-b; do
        id -u "$user" >/dev/null 2>&1 ||
            useradd --system --no-create-home --shell /usr/sbin/nologin "$user"
    done
fi

if ((static)); then
    # Lint and types before the tests (pyproject.toml: [tool.ruff], [tool.mypy]).
    ruff check .
    ruff format --check .
    mypy
fi
# Two xdist workers, a test file each (a file's module fixtures, private brokers and Slurm
# cluster stay in one process); both use the session's shared broker (tests/conftest.py).
# Most of a test's time is waiting for spawns, heartbeats and deadlines, so on CI's two
# cores this takes a fifth off the wall time. CPQ_TEST_WORKERS=0 runs it in one process.
workers=${CPQ_TEST_WORKERS:-2}
xdist=()
if ((workers > 0)); then
    xdist=(-n "$workers" --dist loadfile)
fi
exec python -m pytest -q "${xdist[@]}" "${pytest_args[@]}"
