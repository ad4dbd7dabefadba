"""Starting and killing one group (one torchrun and its ranks), broker side.

A group is ``python -m cpq.rank.launch --standalone --nproc-per-node W -m cpq.rank`` in a
process session of its own. torchrun starts every rank in yet another session, so killing
"the group" means killing a process tree: the agent, everything below it, and every rank
pid the ranks reported themselves. Killing never blocks the broker's event loop: SIGTERM
now, SIGKILL when the grace has passed (:meth:`GroupProcess.reap` is called from the loop's
tick), and the group's GPUs are released only once every process is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
from pathlib import Path

import psutil

from cpq import environ, protocol, spin

log = logging.getLogger("cpq.supervisor")

#: ``fd:dev:inode,...``: the GPU lease descriptors a group inherits. The launcher passes them
#: on to every rank and each rank checks it holds them (:mod:`cpq.rank.leases`).
LEASE_FDS_VAR = "CPQ_LEASE_FDS"  # the name cpq.rank.leases reads


def lease_fds_value(fds: list[int]) -> str:
    out = []
    for fd in fds:
        info = os.fstat(fd)
        out.append(f"{fd}:{info.st_dev}:{info.st_ino}")
    return ",".join(out)


class GroupProcess:
    def __init__(
        self,
        group_id: str,
        spec: protocol.PoolSpec,
        backend: str,
        gpus: list[str],
        backend_endpoint: str,
        heartbeat_s: float,
        liveness: int,
        log_dir: Path,
    ) -> None:
        self.group_id = group_id
        self.spec = spec
        self.backend = backend
        self.gpus = gpus
        self.token = secrets.token_hex(16)
        self.node_gpus = True  # set by the pools from the broker's inventory
        self.backend_endpoint = backend_endpoint
        self.heartbeat_s = heartbeat_s
        self.liveness = liveness
        self.log_dir = log_dir
        self.popen: subprocess.Popen[bytes] | None = None
        self.rank_pids: set[int] = set()
        self.lease_fds: list[int] = []
        self._doomed: list[psutil.Process] = []
        self._kill_at: float | None = None
        self.log_path = log_dir / f"group-{group_id}-agent.log"

    # ---- start

    def environment(self) -> dict[str, str]:
        """The group's environment: the spec's variables (the caller's start variables and
        the task's pinned ones) on a minimal base; nothing else of the broker's own
        environment reaches a group (docs/design.md, "Fidelity: environment")."""
        env = environ.process_base()
        if os.environ.get(spin.SPIN_ENV):  # the broker's spinning is its ranks' (cpq.spin)
            env[spin.SPIN_ENV] = os.environ[spin.SPIN_ENV]
        env.update(dict(self.spec.env))
        callers_gpus = env.pop(environ.GPU_VAR, None)  # it narrowed the GPUs; ours are below
        env.update(protocol.MULTICAST_OFF_ENV)  # never multicast, whatever the caller says
        env.update(
            {
                "CPQ_BACKEND_ENDPOINT": self.backend_endpoint,
                "CPQ_GROUP_ID": self.group_id,
                "CPQ_GROUP_TOKEN": self.token,
                "CPQ_DIST_BACKEND": self.backend,
                "CPQ_HEARTBEAT_S": str(self.heartbeat_s),
                "CPQ_LIVENESS": str(self.liveness),
                "CPQ_ROOTS": os.pathsep.join(self.spec.roots),
                "CPQ_LOG_DIR": str(self.log_dir),
                protocol.FEATURES_ENV: ",".join(sorted(protocol.ALL_FEATURES)),  # what we read
                LEASE_FDS_VAR: lease_fds_value(self.lease_fds),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.gpus or self.node_gpus:  # the broker's to assign; "" keeps a group off them
            env[environ.GPU_VAR] = ",".join(self.gpus)
        elif callers_gpus is not None:  # a node without GPUs: what a fresh rank would see
            env[environ.GPU_VAR] = callers_gpus
        if self.spec.world_size > 1 and "OMP_NUM_THREADS" not in env:
            # torchrun's own default for more than one rank per node when the caller sets
            # none (its agent inside the group sets it too); a single rank keeps torch's.
            env["OMP_NUM_THREADS"] = "1"
        # The rank must import cpq itself; the spec's roots let it import the user's code.
        env["PYTHONPATH"] = os.pathsep.join(
            [p for p in [*self.spec.roots, env.get("PYTHONPATH", "")] if p]
        )
        return env

    def command(self) -> list[str]:
        return [
            self.spec.python,
            "-m",
            "cpq.rank.launch",
            "--standalone",
            "--nproc-per-node",
            str(self.spec.world_size),
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.1",
            "-m",
            "cpq.rank",
        ]

    def start(self) -> None:
        try:
            output: int = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            log.warning(
                "cannot open %s (%s); group %s logs are lost", self.log_path, exc, self.group_id
            )
            output = subprocess.DEVNULL
        try:
            self.popen = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=self.lease_fds,  # the group holds its GPUs' leases until it exits
                cwd=self.spec.roots[0]
                if self.spec.roots and os.path.isdir(self.spec.roots[0])
                else None,
            )
        finally:
            if output >= 0:  # not subprocess.DEVNULL (-3), which is no descriptor of ours
                os.close(output)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def exit_code(self) -> int | None:
        """The agent's exit status once it has ended (reaps it), else None."""
        return self.popen.poll() if self.popen else -1

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                handle.seek(max(0, size - max_bytes))
                return handle.read().decode("utf-8", errors="replace")
        except OSError:
            return ""

    # ---- kill

    def terminate(self, kill_at: float) -> None:
        """SIGTERM the whole tree now; :meth:`reap` sends SIGKILL from ``kill_at`` on.

        Times are the broker clock's (docs/design.md "Time"): the supervisor reads none.
        """
        if self._kill_at is not None:
            return
        self._doomed = self._tree()
        for proc in self._doomed:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)
        self._kill_at = kill_at

    def reap(self, now: float) -> bool:
        """Escalate and collect; True once every process of the group is gone."""
        if self.popen is not None:
            self.popen.poll()
        alive = [p for p in self._doomed if _running(p)]
        if alive and self._kill_at is not None and now >= self._kill_at:
            for proc in alive:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        self._doomed = alive
        return not alive and (self.popen is None or self.popen.returncode is not None)

    def _tree(self) -> list[psutil.Process]:
        procs: dict[int, psutil.Process] = {}
        if self.popen is not None and self.popen.returncode is None:
            with contextlib.suppress(psutil.Error):
                agent = psutil.Process(self.popen.pid)
                procs[agent.pid] = agent
                for child in agent.children(recursive=True):
                    procs[child.pid] = child
        for pid in self.rank_pids:
            with contextlib.suppress(psutil.Error):
                procs.setdefault(pid, psutil.Process(pid))
                for child in procs[pid].children(recursive=True):
                    procs[child.pid] = child
        return list(procs.values())


def _running(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
