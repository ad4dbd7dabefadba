#!/usr/bin/env bash
# The test command: install what is missing, then run cpq's whole test suite.
#
#   tools/test.sh            # what README's quickstart calls "the tests"
#   tools/test.sh --static   # also ruff and mypy first (.ci/run: exactly this)
#   tools/test.sh -- -k fidelity    # arguments after -- go to pytest
#
# The pytests tested: the oldest pyproject allows and the newest release, what `pip install`
# gives a newcomer (CPQ_PYTEST_VERSIONS, "8.2.0 9.2.0" by default). The whole suite runs on
# the newest (this environment gets it; CPQ_PYTEST= keeps the pytest you have). Then a
# second environment: the suites that depend on pytest's own internals (the ranks rebuild
# the caller's pytest session; the toolbox plugins) run again on each other version, in a
# venv of its own made here (.venv-pytest/<version>). Empty CPQ_PYTEST_VERSIONS skips it, as
# does a run given pytest arguments unless CPQ_PYTEST_VERSIONS is set. One full run and one
# second environment, not two: the suite's time (the brief's 20 minutes on CI's 2 cores).
#
# Installs: cpq with its test extra (pinning torch==2.13.0, the version CI tests with; set
# CPQ_TORCH= to keep yours) and the newest tested pytest, and,
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

tested_pytests="${CPQ_PYTEST_VERSIONS-8.2.0 9.2.0}"
newest_pytest=${tested_pytests##* }
# CPQ_TORCH= (empty) keeps the torch you have (a GPU node's CUDA build); CPQ_PYTEST= yours
# shellcheck disable=SC2086  # an empty pin expands to nothing
python -m pip install -q ${CPQ_TORCH-torch==2.13.0} \
    ${CPQ_PYTEST-${newest_pytest:+pytest==$newest_pytest}} -e '.[test]'

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
status=0
# --durations=25: the slowest tests in the log, against the suite's 20-minute aim.
python -m pytest -q --durations=25 "${xdist[@]}" "${pytest_args[@]}" || status=$?

# The second environment (see the top). The oldest is pyproject's lower bound and the newest
# the latest release (tests/unit/test_pytest_versions.py keeps them in step).
if ((${#pytest_args[@]})); then
    versions=${CPQ_PYTEST_VERSIONS-}
else
    versions=$tested_pytests
fi
version_suites=(tests/test_ranks_run_pytest.py tests/test_rank_sessions.py tests/test_toolbox.py)
have=$(python -c 'import pytest; print(pytest.__version__)')
for version in $versions; do
    if [[ $version == "$have" ]]; then
        echo "tools/test.sh: pytest $version: tested above" >&2
        continue
    fi
    venv=.venv-pytest/$version
    [[ -x $venv/bin/python ]] || python -m venv "$venv"
    # shellcheck disable=SC2086  # an empty pin expands to nothing
    "$venv/bin/python" -m pip install -q ${CPQ_TORCH-torch==2.13.0} -e '.[test]' \
        "pytest==$version"
    echo "tools/test.sh: pytest $version: ${version_suites[*]}" >&2
    "$venv/bin/python" -m pytest -q "${xdist[@]}" "${version_suites[@]}" || status=$?
done
exit "$status"
