"""The warm default process group, as the code under test sees it.

Every rank of a warm group initialised ``torch.distributed``'s default group once, at start.
Code written for a fresh ``torchrun`` worker initialises it itself: a conftest fixture, a
``setup_method`` or a script calls ``dist.init_process_group(...)`` with no guard (under
torchrun every process is fresh) and ``dist.destroy_process_group()`` at the end. So in a
rank:

* ``init_process_group`` while the warm default group stands joins it: nothing is created,
  nothing raises "trying to initialize the default process group twice". A backend the warm
  group cannot serve (``nccl`` asked of a ``gloo`` group on a machine with GPUs) is refused,
  as a fresh worker without that backend would refuse it.
* ``destroy_process_group()`` of the default group (no argument, or the group itself) leaves
  it warm but destroys every group the code made, as a fresh process's destroy frees them all
  (their communicators and GPU memory); destroying a group the code made destroys it for real.
* Communicators are lazy, as in a fresh process whose code did not bind a device: the warm
  group is initialised without ``device_id``, so ``new_group`` builds nothing until a group
  is used. Code that passes ``device_id=`` binds the warm group to that device for as long as
  it holds the group (until its ``destroy_process_group()``), so its new groups connect at
  once, as they would in a fresh process. What differs: group names go on counting (a fresh
  process's destroy restarts them at 0; the warm store still holds the old names' keys).
* Groups the code made (``new_group``, a ``DeviceMesh``) and did not destroy are destroyed
  when the pytest session that made them ends in this rank (``cpq.rank.items``), so a
  group a module or session fixture built lives as long as that fixture's scope allows.

Installed once per rank (:func:`install`), after the warm group exists.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("cpq.rank")

_installed = False
_warm: Any = None
#: In a launched script's window (:func:`as_fresh_worker`), or after the code destroyed
#: the default group: hidden from every caller of ``is_initialized`` — torch's own
#: functions too — until the code initialises it, as in a fresh worker.
_hidden = False
#: From a calling pytest session's start (:func:`unshown`): the code's own
#: ``dist.is_initialized()`` says False until it initialises, while torch's functions
#: (``all_reduce``, ``get_rank``: ``distributed_c10d``'s own calls) see the warm group, so a
#: test may still just use it (README).
_unshown = False


def install() -> None:
    """Wrap ``init_process_group``/``destroy_process_group`` (both module attributes)."""
    global _installed, _warm
    if _installed:
        return
    from torch.distributed import distributed_c10d as c10d

    _installed = True
    _warm = c10d._get_default_group()
    real_init, real_destroy = c10d.init_process_group, c10d.destroy_process_group
    real_is_initialized = c10d.is_initialized

    @functools.wraps(real_is_initialized)
    def is_initialized() -> bool:
        return False if _hidden else bool(real_is_initialized())

    @functools.wraps(real_is_initialized)
    def is_initialized_seen() -> bool:  # the code's own view: torch.distributed's attribute
        return False if _hidden or _unshown else bool(real_is_initialized())

    @functools.wraps(real_init)
    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        global _hidden, _unshown, script_initialised
        if not real_is_initialized():
            real_init(backend, *args, **kwargs)
            return
        _hidden = _unshown = False  # the code's own group is the warm one from now on
        script_initialised = _in_script
        asked = str(backend or kwargs.get("backend") or "").lower()
        have = str(c10d.get_backend()).lower()
        if asked and asked not in have and not (asked == "cpu:gloo,cuda:nccl"):
            raise RuntimeError(
                f"init_process_group(backend={asked!r}): this warm group runs {have!r} "
                "(cpq picks nccl on GPUs, gloo without)"
            )
        device = _device_arg(args, kwargs)
        if device is not None:
            _bind(device)

    @functools.wraps(real_destroy)
    def destroy_process_group(group: Any = None) -> None:
        global _hidden, _unshown
        if group is None or group is _warm:
            if _hidden or _unshown:  # a fresh worker's destroy before its init raises
                raise ValueError(
                    "Default process group has not been initialized, please make sure to "
                    "call init_process_group."
                )
            # Left warm, but the code sees it destroyed, as it asked (is_initialized() is
            # False until its next init_process_group), and every group it made is freed.
            _hidden = True
            destroy_made(set())
            _bind(None)
            return
        real_destroy(group)

    wrapped = {
        "init_process_group": (real_init, init_process_group),
        "destroy_process_group": (real_destroy, destroy_process_group),
        "is_initialized": (real_is_initialized, is_initialized),
    }
    # Every torch.distributed module that bound the originals at its import (device_mesh
    # does, `from ... import is_initialized`); modules imported later bind the wrappers.
    # distributed_c10d's own calls see the warm group when only the code's view hides it.
    for name, module in list(sys.modules.items()):
        if module is None or not (
            name == "torch.distributed" or name.startswith("torch.distributed.")
        ):
            continue
        if name != c10d.__name__:
            wrapped["is_initialized"] = (real_is_initialized, is_initialized_seen)
        else:
            wrapped["is_initialized"] = (real_is_initialized, is_initialized)
        for attr, (real, wrapper) in wrapped.items():
            if getattr(module, attr, None) is real:
                setattr(module, attr, wrapper)


#: ``init_process_group``'s positional parameters up to ``device_id`` (after ``backend``).
_INIT_POSITIONAL = (
    "init_method",
    "timeout",
    "world_size",
    "rank",
    "store",
    "group_name",
    "pg_options",
    "device_id",
)


def _device_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``device_id`` the code passed to ``init_process_group`` (None: none)."""
    if "device_id" in kwargs:
        return kwargs["device_id"]
    index = _INIT_POSITIONAL.index("device_id")
    return args[index] if len(args) > index else None


def unshown() -> None:
    """A calling pytest session begins here: as in a fresh ``torchrun`` worker, the code's
    ``dist.is_initialized()`` is False until it initialises the default group (its
    ``init_process_group`` then joins the warm one). Megatron-LM's ``Utils`` sets its device
    up only when it is not initialised: on a CPU host that fails in a fresh run."""
    global _unshown
    _unshown = True


def shown() -> None:
    """A ``@pytest.mark.cpq`` test: its default group is initialised (the marker's promise)."""
    global _unshown
    _unshown = False


def caller_done(before: set[int]) -> None:
    """A calling session or a launch ended here: the groups it made since ``before`` (ids of
    :func:`made_groups` then) are destroyed, the warm group is bound to no device and seen
    initialised again, as the next caller expects to find it."""
    global _hidden, _unshown
    destroy_made(before)
    _bind(None)
    _hidden = _unshown = False


def _bind(device: Any) -> None:
    """Bind the warm group to ``device`` (None: unbind), as the code's own
    ``init_process_group(device_id=...)`` would have bound a fresh one."""
    if _warm is None or not hasattr(_warm, "bound_device_id"):
        return
    if device is not None:
        import torch

        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.index is None:  # torch binds an indexed device only
            return
    try:
        _warm.bound_device_id = device
    except (RuntimeError, TypeError):
        log.warning("could not bind the warm process group to %s", device)


_in_script = False
#: The launched script called ``init_process_group`` (its uncaught exception's lines then
#: carry torch's ``[rank<r>]: `` prefix).
script_initialised = False


@contextlib.contextmanager
def as_fresh_worker() -> Iterator[None]:
    """While a launched script runs: ``is_initialized()`` is False until it initialises."""
    global _hidden, _in_script, script_initialised
    _hidden = _in_script = True
    script_initialised = False
    try:
        yield
    finally:
        _hidden = _in_script = False


def made_groups() -> list[Any]:
    """The process groups that exist now besides the warm default group."""
    from torch.distributed import distributed_c10d as c10d

    if _warm is None:
        return []
    return [pg for pg in list(c10d._world.pg_map) if pg is not _warm]


def destroy_made(before: set[int]) -> None:
    """Destroy the groups made since ``before`` (ids of :func:`made_groups` then)."""
    from torch.distributed import distributed_c10d as c10d

    real_destroy = getattr(c10d.destroy_process_group, "__wrapped__", c10d.destroy_process_group)
    for pg in made_groups():
        if id(pg) not in before:
            try:
                real_destroy(pg)
            except Exception:
                log.exception("destroying a process group a test made failed")


def close_as_dead_worker() -> None:
    """Close every process group of this rank, the warm one too, as the connections of a
    worker whose process ended close: a peer waiting in a collective on this rank (a barrier
    after this rank's script raised) then gets gloo's "Connection closed by peer", as under
    torchrun, instead of waiting for the deadline. gloo closes its sockets only when the
    last reference to the group goes, hence the collection. The rank cannot serve again
    (its caller makes it unfit). NCCL peers inside a kernel do not wake: the broker's
    failure grace ends them (docs/design.md, "Warm torchrun launches")."""
    global _warm
    import gc

    from torch.distributed import distributed_c10d as c10d

    real_destroy = getattr(c10d.destroy_process_group, "__wrapped__", c10d.destroy_process_group)
    for pg in made_groups():
        with contextlib.suppress(Exception):
            real_destroy(pg)
    _warm = None
    if c10d.GroupMember.WORLD is not None:
        try:
            real_destroy()
        except Exception:
            log.exception("closing the warm process group failed")
    gc.collect()


#: Launches this rank ran: every rank of a group runs the same ones in the same order, so
#: the count names one launch in the warm group's store.
_launches = 0
#: How long a failed rank waits for its peers to end their script before it closes its
#: groups (a peer waiting for it in a collective never ends).
PEER_WAIT_S = 0.5


def launch_ended(failed: bool, nproc: int) -> bool:
    """Say in the warm group's store that this rank's script ended; for a failed one, wait
    up to :data:`PEER_WAIT_S` for every peer's. True when the rank must close its groups as
    a dead worker's (:func:`close_as_dead_worker`): a peer has not ended (it may wait for
    this rank in a collective) or the ranks ended after different numbers of collectives
    (one left a message the next launch would read). A launch where every rank ended in
    step keeps its group warm, failed or not."""
    global _launches
    import time

    from torch.distributed import distributed_c10d as c10d

    _launches += 1
    if _warm is None or nproc < 2:
        return False
    try:
        store = c10d._get_default_store()
        prefix = f"cpq/launch/{_launches}"
        rank = c10d.get_rank(_warm)
        sequence = int(getattr(_warm, "_get_sequence_number_for_group")())  # noqa: B009
        store.set(f"{prefix}/seq/{rank}", str(sequence))
        ended = int(store.add(f"{prefix}/ended", 1))
        if not failed:
            return False
        deadline = time.monotonic() + PEER_WAIT_S
        while ended < nproc and time.monotonic() < deadline:
            time.sleep(0.01)
            ended = int(store.add(f"{prefix}/ended", 0))
        if ended < nproc:
            return True
        sequences = {store.get(f"{prefix}/seq/{r}") for r in range(nproc)}
        return len(sequences) != 1
    except Exception:  # a store that fails: the safe side
        log.exception("reading the launch's end from the store failed")
        return failed
