"""A real two-node Slurm cluster on this host, for the fan-out tests (Debian's Slurm 22.05).

munged, slurmctld and two slurmd (nodes ``n1`` and ``n2``, one host) run from a config
generated in a temporary directory, as children of this process so their pids are known.
Teardown cancels every job, waits for the queue to empty, stops the daemons by pid and
then ends any process a job left behind (a shard's broker and its ranks: they are found by
the ``CPQ_STATE_DIR`` under the cluster's directory in their environment), so nothing
outlives the session. Settings and pitfalls: ``slurm.conf`` below, and Slurm's own docs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "srun")
NODES = ("n1", "n2")

CONF = """\
ClusterName=cpqtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.sock,cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
ReturnToService=2
MinJobAge=30
KillWait=5
MailProg=/bin/true
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/d-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
NODE = (
    "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 Sockets=1 "
    "CoresPerSocket=2 ThreadsPerCore=1 RealMemory=10000"
)


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(what: str, predicate: Callable[[], bool], within: float, every: float = 0.1) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` after ``within`` s."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {within:g}s")
        time.sleep(every)


class SlurmCluster:
    """Start with :meth:`start`, always :meth:`stop`; ``env`` is what client commands need."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.conf = directory / "slurm.conf"
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "SLURM_CONF": str(self.conf),
            "HOME": str(directory),
            "LANG": "C.UTF-8",
        }

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        host = socket.gethostname()
        for sub in ("state", *(f"d-{n}" for n in NODES)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        nodes = "\n".join(NODE.format(name=n, host=host, port=_free_port()) for n in NODES)
        self.conf.write_text(
            CONF.format(host=host, ctld_port=_free_port(), dir=self.dir, nodes=nodes)
        )
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld.stdout")
        for name in NODES:
            self._spawn(["slurmd", "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}.out")
        wait_until("working srun", self._srun_works, within=60)

    def _start_munge(self) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        shutil.chown(munge, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        self.dir.chmod(0o755)  # munged checks that others can traverse to its socket
        command = [
            "setpriv", "--reuid=munge", "--regid=munge", "--clear-groups",
            "/usr/sbin/munged", "-F", f"--key-file={key}", "-S", str(munge / "munge.sock"),
            f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        ]  # fmt: skip
        self._spawn(command, "munged.out")
        wait_until("munge socket", lambda: self._alive() and (munge / "munge.sock").exists(), 20)

    def _spawn(self, command: list[str], log: str) -> None:
        with open(self.dir / log, "ab") as out:
            self.daemons.append(
                subprocess.Popen(
                    command,
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )

    def _alive(self) -> bool:
        dead = [d.args[0] for d in self.daemons if d.poll() is not None]
        if dead:
            raise AssertionError(
                f"daemon(s) exited: {dead} (see logs in {self.dir})\n{self.logs()}"
            )
        return True

    def _srun_works(self) -> bool:
        self._alive()
        result = subprocess.run(
            ["srun", "-n1", "-t1", "true"], env=self.env, capture_output=True, timeout=30
        )
        return result.returncode == 0

    def stop(self) -> list[int]:
        """Cancel every job, stop the daemons, end what jobs left; pids that had to be killed."""
        if any(d.poll() is None for d in self.daemons):
            subprocess.run(["scancel", "-u", "root"], env=self.env, capture_output=True)
            with contextlib.suppress(AssertionError, subprocess.SubprocessError):
                wait_until("empty queue", lambda: not self.queue(), within=30, every=0.2)
        for daemon in reversed(self.daemons):  # slurmd, slurmctld, then munged
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in reversed(self.daemons):
            try:
                daemon.wait(5)
            except subprocess.TimeoutExpired:
                daemon.kill()  # slurmd ignores SIGTERM while munge is down
                daemon.wait(5)
        return self.kill_leftovers()

    def _leftovers(self) -> list[int]:
        """Pids whose environment points into this cluster's directory (``TMPDIR``,
        ``CPQ_STATE_DIR`` of a job: its brokers and ranks), other than this process."""
        marker = f"={self.dir}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def kill_leftovers(self, grace_s: float = 10.0) -> list[int]:
        """Give what the jobs started ``grace_s`` to exit, then SIGKILL what is left and
        return those pids (a non-empty answer means a job leaked processes)."""
        with contextlib.suppress(AssertionError):
            wait_until("jobs' processes gone", lambda: not self._leftovers(), grace_s, 0.2)
        found = self._leftovers()
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(AssertionError):
            wait_until("killed processes gone", lambda: not self._leftovers(), 10, 0.1)
        return found

    # ----------------------------------------------------------------- jobs

    def run(
        self,
        *command: str,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        umask: int = -1,
    ) -> str:
        result = subprocess.run(
            command,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
            umask=umask,
        )
        if result.returncode:
            raise AssertionError(f"{' '.join(command)} -> {result.returncode}: {result.stderr}")
        return result.stdout

    def queue(self, job: str = "") -> list[tuple[str, str]]:
        """(job id, state) of queued and running jobs (of ``job`` only, if given)."""
        args = ["squeue", "-h", "-r", "-o", "%i %T"] + (["-j", job] if job else [])
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=30)
        rows = [line.split() for line in result.stdout.splitlines() if line.strip()]
        return [(r[0], r[1]) for r in rows if len(r) == 2]

    def state(self, job: str) -> str:
        """A job's state from ``scontrol`` (kept for MinJobAge after it ended)."""
        out = self.run("scontrol", "-o", "show", "job", job)
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "?")

    def exit_code(self, job: str) -> int:
        """A finished job's exit status (``ExitCode=2:0``: status 2, no signal)."""
        out = self.run("scontrol", "-o", "show", "job", job)
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return int(fields["ExitCode"].split(":")[0])

    def logs(self) -> str:
        parts = []
        for log in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("munge/*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)
