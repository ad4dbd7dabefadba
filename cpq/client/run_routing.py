"""``torch.distributed.run.run(args)`` called in a process, routed to ``cpq torchrun``.

``accelerate launch`` (in process, ``launch_command``, or as a subprocess) parses torchrun's
options itself and calls ``torch.distributed.run.run(args)``; under ``pytest --cpq-torchrun``
that ``run`` is replaced as the module is imported (:class:`RouteOnImport`, also installed by
the route folder's start-up hook in every Python child) or, when it was loaded before, now
(:func:`route_in_process`): the parsed arguments become ``cpq torchrun``'s command line
(:func:`run_argv`; what ``cpq torchrun`` does not read runs the real ``run``, said once), and a
failed rank raises torchrun's ``ChildFailedError`` with each failed rank's exit code
(docs/design.md, "Warm torchrun launches").
"""

from __future__ import annotations

import os
import sys
from typing import Any

from cpq.client.torchrun import FAILURES_VAR

#: What ``run(args)`` may carry for ``cpq torchrun`` to run it: option -> its default. The
#: master address and port are not here: a single-node launch runs on a warm group whatever
#: it names (``accelerate launch`` always names port 29500).
_RUN_DEFAULTS: dict[str, Any] = {
    "rdzv_id": "none",
    "rdzv_conf": "",
    "monitor_interval": 0.1,
    "start_method": "spawn",
    "event_log_handler": "null",
    "role": "default",
    "run_path": False,
    "log_dir": None,
    "redirects": "0",
    "local_addr": None,
    "logs_specs": None,
    "numa_binding": None,
    "virtual_local_rank": False,
    "duplicate_stdout_filters": [],
    "duplicate_stderr_filters": [],
    "signals_to_handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    "shutdown_timeout": None,
}


def run_argv(args: Any) -> list[str] | None:
    """``run(args)``'s parsed arguments as ``cpq torchrun``'s command line; None where an
    option differs from its default in a way cpq does not read (the real run then)."""
    return _run_argv(args)[0]


def _run_argv(args: Any) -> tuple[list[str] | None, str]:
    """``(the command line, "")`` or ``(None, why the real run runs)``."""
    values = vars(args)
    for name, default in _RUN_DEFAULTS.items():
        if name in values and values[name] != default:
            return None, f"--{name.replace('_', '-')}={values[name]!r}, which cpq does not read"
    argv = [
        f"--nnodes={values.get('nnodes', '1:1')}",
        f"--nproc-per-node={values.get('nproc_per_node', '1')}",
        f"--max-restarts={values.get('max_restarts', 0)}",
        f"--rdzv-backend={values.get('rdzv_backend', 'static')}",
        f"--node-rank={values.get('node_rank', 0)}",
    ]
    if values.get("rdzv_endpoint"):
        argv.append(f"--rdzv-endpoint={values['rdzv_endpoint']}")
    if values.get("tee", "0") not in ("0", 0, None):
        argv.append(f"--tee={values['tee']}")
    if values.get("local_ranks_filter"):
        argv.append(f"--local-ranks-filter={values['local_ranks_filter']}")
    for flag in ("standalone", "no_python", "module"):
        if values.get(flag):
            argv.append("--" + flag.replace("_", "-"))
    script = values.get("training_script")
    if not script:
        return None, "no script to run"
    return [*argv, str(script), *[str(a) for a in values.get("training_script_args") or []]], ""


def patch_run(module: Any) -> None:
    """Replace ``module.run`` (``torch.distributed.run``'s) by one that runs ``cpq
    torchrun`` and, when a rank failed, raises torchrun's ``ChildFailedError`` with each
    failed rank's exit code, as the real ``run`` does."""
    real = getattr(module, "run", None)
    if real is None or getattr(real, "_cpq_routed", False):
        return

    def run(args: Any) -> None:
        argv, why = _run_argv(args)
        if argv is None:
            sys.stderr.write(f"cpq torchrun: running the real torchrun: {why}\n")
            sys.stderr.flush()
            real(args)
            return
        import json
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory(prefix="cpq-run-") as folder:
            path = os.path.join(folder, "failures.json")
            env = dict(os.environ, **{FAILURES_VAR: path})
            command = [sys.executable, "-m", "cpq", "torchrun", *argv]
            done = subprocess.run(command, env=env, check=False)
            try:
                with open(path) as source:
                    codes = {int(r): int(c) for r, c in json.load(source).items()}
            except (OSError, ValueError):
                codes = {}
        if done.returncode != 0:
            from torch.distributed.elastic.multiprocessing.errors import (
                ChildFailedError,
                ProcessFailure,
            )

            codes = codes or {0: done.returncode}
            failures = {r: ProcessFailure(r, 0, c, "") for r, c in sorted(codes.items())}
            raise ChildFailedError(name=str(args.training_script), failures=failures)

    run._cpq_routed = True  # type: ignore[attr-defined]
    run.__wrapped__ = real  # type: ignore[attr-defined]
    setattr(module, "run", run)  # noqa: B010 - a module mypy knows without this attribute


def route_in_process() -> None:
    """Replace ``torch.distributed.run.run`` if that module is loaded here."""
    module = sys.modules.get("torch.distributed.run")
    if module is not None:
        patch_run(module)


class _Patching:
    """A loader that runs the real one, then :func:`patch_run` on the module."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        patch_run(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... of the real one
        return getattr(self.inner, name)


class RouteOnImport:
    """A ``sys.meta_path`` finder: ``torch.distributed.run`` is routed as it is imported
    (``accelerate launch`` imports it inside the call that runs the launch)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch.distributed.run":
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patching(spec.loader)  # type: ignore[assignment]
        return spec


def route_on_import() -> RouteOnImport:
    """Route ``torch.distributed.run.run`` here: now if loaded, else once imported."""
    route_in_process()
    for finder in sys.meta_path:
        if isinstance(finder, RouteOnImport):
            return finder
    finder = RouteOnImport()
    sys.meta_path.insert(0, finder)
    return finder
