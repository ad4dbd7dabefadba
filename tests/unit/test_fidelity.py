"""Fidelity rules on fakes: changed code, abandoned tasks, waiting notices, the caller's
environment, closing notices, compatibility with older peers (docs/design.md, "Fidelity")."""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpq import environ, protocol
from cpq.broker.placement.admission import impossible
from cpq.broker.placement.plan import NO_TASK, Plan
from cpq.broker.placement.view import GroupView, Room
from cpq.broker.refusals import MAX_STALE_BOUNCES
from cpq.protocol import PoolSpec
from cpq.rank import cancel, freshness
from cpq.rank.io import CPQ_DIR, user_stack
from cpq.timings import _parse, history_key

from .fakes import Sim, spec

FEATURES = sorted(protocol.ALL_FEATURES)


def done(sim: Sim, group_id: str, rank: int, task_id: str, **fields: object) -> None:
    """A rank's report with the fidelity fields (``stale``, ``pg_seq``)."""
    result = protocol.RankResult(rank=rank, outcome="passed")
    sim.rank_send(
        sim.rank_id(group_id, rank),
        protocol.RankDone(task_id=task_id, result=result, **fields),  # type: ignore[arg-type]
    )


# --------------------------------------------------------------------------- changed code


def test_a_stale_group_is_replaced_and_the_task_runs_on_a_fresh_one() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    task = sim.submit()
    sim.bring_up("g1")
    done(sim, "g1", 0, task, stale="/project/mylib.py", stale_kind="code")
    assert sim.states()["g1"] == "stopping"
    assert sim.broker.pools.groups["g1"].stop_reason == "code changed: /project/mylib.py"
    assert "g2" in sim.states()  # the queue had no group left: a fresh one starts
    sim.bring_up("g2")
    assert sim.running("g2") == task
    sim.finish_all("g2", task)
    (result,) = sim.done().values()
    assert result.outcome == "passed" and result.attempts == 1 and result.notes == []
    assert result.groups == ["g2"]  # nothing ran on g1
    assert sim.broker.totals.groups_recycled == 1 and sim.broker.totals.retries == 0


def test_a_file_that_keeps_changing_ends_in_an_error_not_a_loop() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    task = sim.submit(pool_spec=spec(1))
    for n in range(1, MAX_STALE_BOUNCES + 2):
        sim.tick(0.1)  # the stopped group is reaped, its rank slots come back
        group_id = f"g{n}"
        sim.bring_up(group_id)
        done(sim, group_id, 0, task, stale="/project/generated.py", stale_kind="code")
    (result,) = sim.done().values()
    assert result.outcome == "error" and "keeps changing" in result.message


def test_a_stale_report_after_the_client_left_ends_the_task() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    sim.client_send(b"c1", protocol.Goodbye())
    done(sim, "g1", 0, task, stale="/project/mylib.py", stale_kind="code")
    sim.tick(0.1)
    assert sim.broker.tasks.tasks == {} and len(sim.broker.tasks.queues) == 0


# --------------------------------------------------------------------------- abandoned


def test_a_client_that_leaves_gets_its_running_task_interrupted_and_the_group_kept() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    task = sim.submit()
    sim.bring_up("g1")
    sim.client_send(b"c1", protocol.Goodbye())
    cancels = sim.sent_to_ranks(protocol.CancelTask)
    assert sorted(who for who, _ in cancels) == [sim.rank_id("g1", 0), sim.rank_id("g1", 1)]
    assert all(m.task_id == task for _, m in cancels)
    done(sim, "g1", 0, task, pg_seq=7)
    done(sim, "g1", 1, task, pg_seq=7)
    assert sim.states() == {"g1": "idle"}  # clean: the same collectives on every rank
    assert sim.done() == {}  # nobody to tell
    assert sim.broker.totals.errors == 1 and sim.broker.totals.groups_recycled == 0


@pytest.mark.parametrize("seqs", [(3, 4), (-1, -1), (5, -1)])
def test_an_interrupt_mid_collective_recycles_the_group(seqs: tuple[int, int]) -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    task = sim.submit()
    sim.bring_up("g1")
    sim.client_send(b"c1", protocol.Goodbye())
    for rank, seq in enumerate(seqs):
        done(sim, "g1", rank, task, pg_seq=seq)
    assert sim.states() == {"g1": "stopping"}
    assert "mid-collective" in sim.broker.pools.groups["g1"].stop_reason


def test_ranks_that_do_not_stop_get_their_group_recycled_after_the_grace() -> None:
    sim = Sim(cancel_grace_s=3.0)
    sim.client(features=FEATURES)
    task = sim.submit()
    sim.bring_up("g1")
    sim.processes["g1"].gone_after_terminate = False  # keep it visible while stopping
    sim.report("g1", 0, task)  # rank 0 was done already: only rank 1 is asked
    sim.client_send(b"c1", protocol.Goodbye())
    assert [who for who, _ in sim.sent_to_ranks(protocol.CancelTask)] == [sim.rank_id("g1", 1)]
    sim.tick(2.5)
    assert sim.states() == {"g1": "busy"}
    sim.tick(1.0)
    assert sim.states() == {"g1": "stopping"}
    assert "did not stop within 3s" in sim.broker.pools.groups["g1"].stop_reason
    assert sim.broker.tasks.tasks == {}


def test_a_silent_client_counts_as_gone() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    sim.submit()
    sim.bring_up("g1")
    sim.broker.clients[b"c1"].last_seen -= 60  # it stopped heartbeating long ago
    sim.tick(0.1, heartbeats=False)
    assert len(sim.sent_to_ranks(protocol.CancelTask)) == 2


def test_a_cancel_message_interrupts_a_running_task_too() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    task = sim.submit(pool_spec=spec(1))
    sim.bring_up("g1")
    sim.client_send(b"c1", protocol.Cancel(task_id=task))
    assert len(sim.sent_to_ranks(protocol.CancelTask)) == 1
    done(sim, "g1", 0, task, pg_seq=1)
    assert sim.states() == {"g1": "idle"} and sim.done() == {}


# --------------------------------------------------------------------------- waiting


def waiting(sim: Sim, client: bytes = b"c1") -> list[protocol.Waiting]:
    return [
        m for who, m in sim.wire.to_clients if who == client and isinstance(m, protocol.Waiting)
    ]


def test_a_queued_task_hears_why_it_waits_every_few_seconds() -> None:
    sim = Sim(max_ranks=2, waiting_notice_s=3.0)
    sim.client(features=FEATURES)
    first = sim.submit()
    sim.bring_up("g1")
    second = sim.submit()
    sim.tick(2.5)
    assert waiting(sim) == []
    sim.tick(1.0)
    (notice,) = waiting(sim)
    assert notice.task_id == second
    assert "waiting for a ws2/auto group" in notice.message and "1 busy" in notice.message
    assert "0 of 2 CPU ranks free" in notice.message
    sim.tick(3.0)
    assert len(waiting(sim)) == 2
    sim.finish_all("g1", first)
    assert sim.running("g1") == second


def test_an_older_client_gets_no_waiting_or_closing_messages() -> None:
    sim = Sim(max_ranks=2)
    sim.client()  # no features: a client of an older cpq would refuse unknown kinds
    sim.submit()
    sim.bring_up("g1")
    sim.submit()
    sim.tick(7.0)
    sim.broker.stop_now("idle")
    kinds = {type(m) for _, m in sim.wire.to_clients}
    assert protocol.Waiting not in kinds and protocol.Closing not in kinds


def test_a_stopping_broker_tells_its_clients_why() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    sim.client(b"c2", features=FEATURES)
    sim.client_send(b"c1", protocol.StopRequest(drain=True))
    sim.tick(0.1)
    for client in (b"c1", b"c2"):
        closing = [
            m for who, m in sim.wire.to_clients if who == client and isinstance(m, protocol.Closing)
        ]
        assert [m.reason for m in closing] == ["drained"]


# --------------------------------------------------------------------------- environment


def test_the_callers_task_variables_travel_with_the_task() -> None:
    sim = Sim()
    sim.client(features=FEATURES)
    sim.client_send(
        b"c1",
        protocol.Submit(
            task_id="t1", target="m:f", spec=spec(1), env={"MYPROJ_FLAG": "on", "HOME": "/h"}
        ),
    )
    sim.bring_up("g1")
    ((_, run),) = sim.sent_to_ranks(protocol.RunTask)
    assert run.env == {"MYPROJ_FLAG": "on", "HOME": "/h"}


def test_an_old_client_gets_results_without_fields_it_cannot_read() -> None:
    sim = Sim()
    sim.client(b"old")  # no features: a client of an older cpq refuses unknown fields
    sim.client(b"new", features=FEATURES)
    task = sim.submit(b"old", pool_spec=spec(1))
    sim.bring_up("g1")
    sim.finish_all("g1", task)
    task = sim.submit(b"new", pool_spec=spec(1))  # the same warm group
    sim.finish_all("g1", task)
    (old,) = sim.done(b"old").values()
    (new,) = sim.done(b"new").values()
    assert old.outcome == new.outcome == "passed"
    assert new.groups == ["g1"] and old.groups == []  # left out of the old client's frame


def caller(**extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin", "HOME": "/home/me", **extra}


def test_split_sorts_variables_into_start_and_task_variables() -> None:
    start, task = environ.split(
        caller(
            OMP_NUM_THREADS="4",
            NCCL_DEBUG="INFO",
            LD_LIBRARY_PATH="/x",
            PYTHONHASHSEED="0",
            CUDA_VISIBLE_DEVICES="1",
            RANK="3",
            MASTER_PORT="1234",
            TORCHELASTIC_RUN_ID="x",
            NVTE_FLASH_ATTN="0",
            MYPROJ_MODE="fast",
            CPQ_SPEC_ENV="MYPROJ_MODE",
        )
    )
    assert start == {
        "OMP_NUM_THREADS": "4",
        "NCCL_DEBUG": "INFO",
        "LD_LIBRARY_PATH": "/x",
        "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": "1",
        "MYPROJ_MODE": "fast",
        "CPQ_SPEC_ENV": "MYPROJ_MODE",
    }
    assert task == {"PATH": "/usr/bin", "HOME": "/home/me", "NVTE_FLASH_ATTN": "0"}


GROUP = {
    "PATH": "/broker/bin",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "TORCHELASTIC_RUN_ID": "r",
    "CUDA_VISIBLE_DEVICES": "2,3",
    "OMP_NUM_THREADS": "1",
    "CPQ_GROUP_TOKEN": "secret",
    "BROKER_ONLY": "leak",
}


def test_the_task_environment_is_the_callers_plus_what_the_group_owns() -> None:
    env = environ.task_environ(
        caller(MYPROJ_FLAG="on", RANK="9", CPQ_GROUP_TOKEN="forged", OMP_NUM_THREADS="8"),
        GROUP,
        kept={"NVTE_CUDA_INCLUDE_DIR": "/te"},
    )
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/home/me",
        "MYPROJ_FLAG": "on",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "TORCHELASTIC_RUN_ID": "r",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "OMP_NUM_THREADS": "1",  # a start variable: the group's (equal to the spec's)
        "CPQ_GROUP_TOKEN": "secret",
        "NVTE_CUDA_INCLUDE_DIR": "/te",
        **environ.MULTICAST_OFF_ENV,  # forced in every task, whatever anyone says
    }


NAMES = st.sampled_from(
    ["PATH", "HOME", "RANK", "MASTER_PORT", "OMP_X", "NCCL_Y", "CUDA_VISIBLE_DEVICES", "A", "B"]
)
ENVS = st.dictionaries(NAMES, st.text(max_size=3))


@given(ENVS, ENVS)
def test_no_broker_variable_reaches_a_task_unless_the_group_owns_it(
    caller_env: dict[str, str], group_env: dict[str, str]
) -> None:
    env = environ.task_environ(caller_env, group_env, {})
    for name, value in env.items():
        owned = environ.is_launcher_var(name) or environ.is_start_var(name)
        if name in environ.MULTICAST_OFF_ENV:
            assert value == environ.MULTICAST_OFF_ENV[name]  # cpq's, never the caller's
        elif not owned and name != environ.GPU_VAR:
            assert caller_env.get(name) == value  # every task variable is the caller's
    for name in caller_env:
        if not environ.is_launcher_var(name) and not environ.is_start_var(name):
            assert name in env  # no task variable of the caller's is lost
    assert environ.MULTICAST_OFF_ENV.items() <= env.items()


def test_a_callers_cuda_visible_devices_narrows_the_gpus() -> None:
    room = Room(("0", "1", "2", "3"), max_ranks=8)
    narrowed = spec(2, env=[("CUDA_VISIBLE_DEVICES", "2,3")])
    assert impossible(narrowed, room) is None
    assert place_on(room, narrowed, []) == ("2", "3")
    on_23 = GroupView("g1", narrowed, "idle", ("2", "3"), cpu=False)
    assert place_on(room, narrowed, [on_23]) is None  # 0 and 1 are free, not this caller's
    assert place_on(room, spec(2), [on_23]) == ("0", "1")
    hidden = spec(1, env=[("CUDA_VISIBLE_DEVICES", "")])
    assert "allows 0 of this broker's GPUs" in (impossible(hidden, room) or "")
    assert environ.gpu_filter({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert environ.gpu_filter({}) is None


def place_on(room: Room, pool_spec: PoolSpec, groups: list[GroupView]) -> tuple[str, ...] | None:
    """Where placement would start a group of ``pool_spec`` beside ``groups``."""
    from cpq.broker.placement.history import History
    from cpq.broker.placement.view import Snapshot

    snapshot = Snapshot(0.0, 0.0, room, tuple(groups), (), History())
    return Plan(snapshot).gpus_for(pool_spec, NO_TASK)


# --------------------------------------------------------------------------- rank side


def test_the_code_watch_sees_edits_new_packages_and_files_changed_while_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    monkeypatch.setattr(freshness, "_library_dirs", lambda: ([], [str(site_dir)]))
    module = tmp_path / "cpq_watch_probe.py"
    module.write_text("X = 1\n")
    old = time.time_ns() - 10**9
    os.utime(module, ns=(old, old))
    monkeypatch.syspath_prepend(str(tmp_path))
    watch = freshness.CodeWatch()
    import cpq_watch_probe  # noqa: F401

    watch.scan(time.time_ns())
    assert str(module) in watch.files and watch.changed() == ""
    module.write_text("X = 22\n")
    assert watch.changed() == str(module)
    module.write_text("X = 1\n")
    os.utime(module, ns=(old, old))
    assert watch.changed() == ""
    (site_dir / "newpkg-1.0.dist-info").mkdir()  # pip installed something
    assert watch.changed() == str(site_dir)

    fresh = freshness.CodeWatch()
    fresh.scan(old)  # the scan's window began before the file's last change
    assert fresh.files[str(module)] == (-1, -1) and fresh.changed() == str(module)


@pytest.mark.parametrize(
    "where",
    [
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "TORCH_EXTENSIONS_DIR",
        "CPQ_UNWATCHED",
        "HOME/.triton/cache",  # the defaults, with no variable set
        "XDG_CACHE_HOME/torch_extensions",
    ],
)
def test_generated_code_in_a_compiler_cache_is_not_watched_but_the_users_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A JIT compiler writes a module during the task that imports it (and another process
    rewrites it): in its cache that is not a code change; in the project it still is."""
    monkeypatch.setattr(freshness, "_library_dirs", lambda: ([], []))
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        monkeypatch.delenv(name, raising=False)
    cache, project = tmp_path / "cache", tmp_path / "project"
    variable, _, below = where.partition("/")
    monkeypatch.setenv(variable, str(cache))
    cache = cache / below / "3f2a9c" if below else cache
    cache.mkdir(parents=True)
    project.mkdir()
    started = time.time_ns()
    names = {cache: "cpq_generated_3f2a9c", project: "cpq_written_now"}
    try:
        for directory, name in names.items():
            (directory / f"{name}.py").write_text("VALUE = 42\n")  # written during the task
            monkeypatch.syspath_prepend(str(directory))
            importlib.import_module(name)
        watch = freshness.CodeWatch()
        watch.scan(started)
    finally:
        for name in names.values():
            sys.modules.pop(name, None)
    (cache / "cpq_generated_3f2a9c.py").write_text("VALUE = 42\n")  # another group compiled it
    assert str(cache / "cpq_generated_3f2a9c.py") not in watch.files
    assert watch.changed() == str(project / "cpq_written_now.py")


def test_a_rank_does_not_watch_cpqs_own_modules_but_the_warm_caller_does() -> None:
    """A rank runs its broker's cpq (the caller compares code fingerprints): an edit of cpq
    is not a change of the code under test, and a group restarted on it would run new rank
    code under the old broker. The project's modules beside cpq stay watched. The warm
    caller forks the caller's own pytest process, whose cpq must be the edited one."""
    import cpq
    import workers.collectives

    own = os.path.realpath(os.path.dirname(cpq.__file__)) + os.sep
    rank = freshness.CodeWatch(cpq=False)
    rank.scan(0)
    assert not [path for path in rank.files if path.startswith(own)]
    assert os.path.realpath(workers.collectives.__file__) in rank.files
    # the warm caller forks a caller's pytest process: its cpq is the caller's code
    caller = freshness.CodeWatch()
    caller.scan(0)
    assert [path for path in caller.files if path.startswith(own)]


def test_tritons_home_cache_stays_unwatched_after_inductor_moves_triton_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on the H200 pair: once imported, TorchInductor sets TRITON_CACHE_DIR to its own
    directory, after Triton's driver built ``cuda_utils`` in ``~/.triton``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inductor" / "triton" / "0"))
    dirs = freshness.cache_dirs()
    assert str(tmp_path / "home" / ".triton" / "cache") + os.sep in dirs
    assert str(tmp_path / "inductor" / "triton" / "0") + os.sep in dirs


def test_code_under_the_user_cache_stays_watched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~/.cache`` also holds the user's code (Hugging Face's trust_remote_code copies of
    a local model, torch hub checkouts): only the compilers' own directories are left out."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    modeling = tmp_path / ".cache" / "huggingface" / "modules" / "my_model" / "modeling.py"
    assert not str(modeling).startswith(tuple(freshness.cache_dirs()))


def test_a_reexecuted_test_module_is_not_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freshness, "_library_dirs", lambda: ([], []))
    monkeypatch.setattr(freshness, "reexecuted", {__name__})
    watch = freshness.CodeWatch()
    watch.scan(0)
    assert __file__ not in watch.files


def test_cancel_interrupts_a_blocking_call_in_the_main_thread() -> None:
    cancel.install()
    try:
        main = threading.main_thread().ident
        timer = threading.Timer(0.2, cancel.request, args=("task-a", main))
        with pytest.raises(cancel.TaskCancelled), cancel.window("task-a"):
            timer.start()
            time.sleep(30)
        timer.join()
        with pytest.raises(cancel.TaskCancelled), cancel.window("task-a"):
            pass  # cancelled before it started: it never runs
        cancel.request("task-a", main)  # too late: nothing runs, nothing is raised
        with cancel.window("task-b"):
            assert cancel.current() == "task-b"
        assert cancel.current() == ""
    finally:
        signal.signal(cancel.SIGNAL, signal.SIG_DFL)
        cancel._state.requested = ""


def test_a_reported_stack_starts_at_the_users_code() -> None:
    frames = traceback.StackSummary.from_list(
        [
            ("/usr/lib/python3/runpy.py", 1, "_run_module_as_main", "x"),
            (CPQ_DIR + "rank/runtime.py", 2, "run_task", "value = function(**kwargs)"),
            ("/project/test_hang.py", 3, "test_hangs", "wait_forever()"),
            ("/project/test_hang.py", 4, "wait_forever", "time.sleep(0.1)"),
        ]
    )
    text = user_stack(frames)
    assert "runpy" not in text and "runtime.py" not in text
    assert text.count("test_hang.py") == 2


# --------------------------------------------------------------------------- history


def test_timing_history_is_kept_per_project() -> None:
    assert history_key("/a", "t.py::x", "m:f") != history_key("/b", "t.py::x", "m:f")
    assert history_key("", "t.py::x", "m:f") == "t.py::x"
    old_record = {
        "finished_at": 1.0,
        "target": "m:f",
        "test_id": "t.py::x",
        "spec": "ws2/gloo",
        "world_size": 2,
        "outcome": "passed",
        "duration_s": 0.5,
        "queue_s": 0.0,
        "attempts": 1,
        "retries": 0,
        "group_id": "g1",
        "deadline_s": 90.0,
    }
    timing = _parse(json.dumps(old_record))  # written before projects were recorded
    assert timing is not None and timing.project == "" and timing.key == "t.py::x"


def test_a_pinned_variable_is_the_tasks_too() -> None:
    """``env=`` pins a variable on the spec (its groups start with it) and the task sees it:
    before, a name outside the start prefixes was dropped from the task's environment, and a
    rank whose imports had read it refused every task (found on the H200 host)."""
    from cpq.client.api import submit_message

    message, _ = submit_message("m:f", 1, {}, {"env": {"MYPROJ_PINNED": "a"}})
    assert ["MYPROJ_PINNED", "a"] in [list(pair) for pair in message.spec.env]
    group = {"MYPROJ_PINNED": "a", "PATH": "/usr/bin"}  # the rank's start environment
    assert environ.task_environ(message.env, group, {})["MYPROJ_PINNED"] == "a"
