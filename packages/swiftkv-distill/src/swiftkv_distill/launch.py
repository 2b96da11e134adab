"""How the processes of a run start: the launch checks made before any process starts, and, under ``torchrun`` or
``fabric run``, the one meeting of every process before the process group exists.

A process that stops before the process group exists (a setting, a path or a checkpoint its node lacks) would leave
the others waiting to form the group until its timeout (``trainer.strategy.timeout``, 30 min by default), to fail
without its reason: the launcher of each node watches that node's processes alone. So every process says how its
start went, through the store that the launcher of node 0 holds from before the processes start (the process group
uses it too), and a process that stopped stops the others with its reason. A process killed hard before then (a
signal, the out-of-memory killer, a lost node) says nothing: each process counts up a key of its own from a thread
while it starts, and a process whose count stands still for ``SWIFTKV_START_SILENCE`` seconds is taken as stopped.
(A start is seconds: the settings, the model's config, a checkpoint's settings. The weights load later, in the
process group, whose own timeout applies there.)"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch

# what a launcher on several nodes sets: torchrun / fabric run, SLURM, Open MPI, LSF, or by hand (Lightning's own
# environment reads MASTER_ADDR and NODE_RANK)
MULTI_NODE_LAUNCH = (
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "LSB_JOBID",
    "MASTER_ADDR",
)


def check_launch(trainer, environ) -> None:
    """Refuse ``trainer.num_nodes`` > 1 started without a multi-node launcher: the command would start this node's
    processes only, and they would wait for the others' until the process group's timeout (30 min)."""
    num_nodes, devices = trainer.num_nodes, trainer.devices
    if num_nodes <= 1 or any(environ.get(name) for name in MULTI_NODE_LAUNCH):
        return
    raise ValueError(
        f"trainer.num_nodes is {num_nodes}, and no multi-node launcher started this process: it would start this "
        "node's processes only and wait for the others' for 30 minutes. On each node run `fabric run --num_nodes "
        f"{num_nodes} --node_rank RANK --main_address FIRST_NODE --accelerator cuda --devices {devices} "
        "apps/distill.py --config ...` (`lightning run model` before Lightning 2.3; torchrun and SLURM's `srun "
        f"--kill-on-bad-exit=1` work too); on one node pass --trainer.num_nodes 1 "
        f"--trainer.strategy.data_parallel_size {devices} {same_global_batch(trainer, num_nodes)}."
    )


def same_global_batch(trainer, times: int) -> str:
    """What keeps a recipe's global batch, and its validations every so many steps, on ``times`` fewer processes:
    Lightning counts ``val_check_interval`` in batches, and a step is then ``times`` of them."""
    fix = f"--trainer.accumulate_grad_batches {times}"
    if isinstance(trainer.val_check_interval, int):
        fix += f" --trainer.val_check_interval {trainer.val_check_interval * times}"
    return f"(the global batch is then {times}x smaller: {fix} keep it, and the recipe's validations)"


def node_devices(accelerator) -> int | float:
    """The processes a node can start for ``accelerator``: its GPUs (none seen: 0), or any number on the CPU."""
    if str(accelerator) == "cpu" or (str(accelerator) == "auto" and not torch.cuda.is_available()):
        return float("inf")
    return torch.cuda.device_count()  # 0 where torch sees no GPU


def check_world_size(trainer, environ) -> None:
    """Refuse a ModelParallelStrategy whose data x tensor parallel size is not the processes the trainer starts
    (``devices`` x ``num_nodes``), before any process starts: Lightning finds it only once every process is up."""
    strategy = trainer.strategy
    if not str(getattr(strategy, "class_path", "")).endswith("ModelParallelStrategy"):
        return
    # the command line's devices "1" is a string (Lightning's type: list, str or int)
    sizes = [strategy.init_args.data_parallel_size, strategy.init_args.tensor_parallel_size, trainer.devices]
    if not all(isinstance(n, int) or (isinstance(n, str) and n.isdigit()) for n in sizes):
        return  # "auto" (Lightning's own choice) or a list of devices
    dp, tp, devices = map(int, sizes)
    processes = devices * trainer.num_nodes
    if dp * tp == processes:
        return
    fixes = [f"set --trainer.strategy.data_parallel_size {max(processes // tp, 1)}"]
    if processes == 1:
        fixes[0] += ", or --trainer.strategy auto"
    if processes < dp * tp and (dp * tp) % processes == 0:
        fixes[0] += f" {same_global_batch(trainer, dp * tp // processes)}"
    if environ.get("LT_DEVICES"):
        # fabric run starts --devices processes (1 when not given) on each of --num_nodes nodes (1 when not given),
        # which become trainer.devices and num_nodes: the fix is more nodes, or more devices where a node has them
        per_node, nodes = (dp * tp) // trainer.num_nodes, (dp * tp) // devices
        if devices > 1 and nodes > trainer.num_nodes and (dp * tp) % devices == 0:
            fixes.insert(0, f"give `fabric run` --num_nodes {nodes} (it started {trainer.num_nodes})")
        if (dp * tp) % trainer.num_nodes == 0 and per_node <= node_devices(trainer.accelerator):
            fixes.insert(0, f"give `fabric run` --devices {per_node} (it started {devices} a node)")
    raise ValueError(
        f"trainer.strategy's data_parallel_size {dp} x tensor_parallel_size {tp} = {dp * tp} processes, but "
        f"trainer.devices {devices} x num_nodes {trainer.num_nodes} start {processes}: {'; or '.join(fixes)}."
    )


# Lightning's default process group timeout, which its strategies take as ``timeout``
DEFAULT_TIMEOUT = timedelta(minutes=30)
# how long a process that stopped waits quietly for the others to hear of it before it says so
QUIET_WAIT = timedelta(seconds=10)
# how often a waiting process looks at the store, and a starting one counts up its key
POLL_SECONDS = 1.0
# how long a process whose count stands still is waited for (SWIFTKV_START_SILENCE, in seconds; process 0's
# decides): well above the longest a starting process holds Python's GIL, far below the process group's 30 minutes
SILENCE = timedelta(minutes=3)
# the reason given for a process whose count stood still
SILENT = (
    "no word from it for {silence} before the run started: killed (the out-of-memory killer, a signal) or its node "
    "lost; its node's output and kernel log (`dmesg`) say which. SWIFTKV_START_SILENCE sets this wait, in seconds"
)
_met, _timeout, _silence, _answering = False, DEFAULT_TIMEOUT, SILENCE, None


def wait_as(trainer) -> None:
    """The processes wait for each other at the start as long as the process group would (``timeout``), from
    here on: also a process that stops after the Trainer is made."""
    global _timeout
    _timeout = getattr(trainer.strategy, "_timeout", None) or DEFAULT_TIMEOUT


def bad_input(error: BaseException) -> bool:
    """Whether ``error`` is bad input, which the command prints in one line (``cli.main``), on every process."""
    import argparse

    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from .console import OutOfMemory

    bad = (ValueError, FileNotFoundError, argparse.ArgumentError, OutOfMemory, MisconfigurationException)
    return isinstance(error, bad)


class LaunchError(RuntimeError):
    """This process stops for another one (``raise_stop``) or for the launch (its store gone, a process that never
    came): its own traceback tells nothing, so the command prints it in one line."""


def start_answering() -> None:
    """From the start of a process of a launch with a store (``_launch_store``) until its meeting: its ``where`` key
    names its node, and a thread of its own counts up its ``beat`` key every ``POLL_SECONDS``, so that a process
    still starting is told from one killed hard. The first thing a process does (``cli.main``); a second call does
    nothing."""
    global _silence, _answering
    value = os.environ.get("SWIFTKV_START_SILENCE", str(SILENCE.total_seconds()))
    try:
        silence = timedelta(seconds=float(value))
    except (ValueError, OverflowError):
        silence = timedelta(0)
    if silence.total_seconds() < 3 * POLL_SECONDS:
        raise ValueError(
            f"SWIFTKV_START_SILENCE is {value!r}: give the seconds a process of a launch that stops answering before "
            f"the run starts is waited for, at least {3 * POLL_SECONDS:.0f} (default {SILENCE.total_seconds():.0f}), "
            "or leave it unset."
        )
    _silence = silence
    store = None if _answering is not None else _launch_store(timedelta(minutes=1))
    if store is None:
        return
    rank = int(os.environ["RANK"])
    store.set(f"where/{rank}", where())
    stop = threading.Event()
    answer = threading.Thread(target=_answer, args=(store, f"beat/{rank}", stop, POLL_SECONDS), daemon=True)
    _answering = (stop, answer)
    answer.start()
    atexit.register(_stop_answering)  # not in a store call as the interpreter ends (--help, Ctrl-C)


def _answer(store, key: str, stop: threading.Event, every: float) -> None:
    """Count up ``key`` every ``every`` seconds until ``stop``."""
    from torch.distributed import DistNetworkError

    while not stop.is_set():
        try:
            store = store or _launch_store(timedelta(minutes=1))
            store.add(key, 1)
        except DistNetworkError:
            # not reached again: the store is gone (node 0's launcher ended), and the meeting says so; else a reply
            # that took over a minute left the connection unusable: connect again
            if store is None:
                return
            store = None
            continue
        except Exception:  # the next count makes up for it
            pass
        stop.wait(every)


def _stop_answering() -> None:
    """Stop this process's counting thread, if it has one, and let it finish its call to the store."""
    if _answering is not None:
        _answering[0].set()
        _answering[1].join(timeout=5)


def meet_at_start(stopped: tuple[bool, str] | None = None, timeout: timedelta | None = None) -> None:
    """Where the processes of a ``torchrun`` / ``fabric run`` launch meet once, before the process group exists:
    each with ``stopped`` None once its checks passed (just before the Trainer runs), or ``(bad_input, message)``
    from the command as it stops. A process that reaches it well raises the first stop of another process
    (``raise_stop``); one that stopped returns. Where one stopped, every process first waits until all have heard
    of it: a launcher stops its node's processes as soon as one of them ends, and node 0's, which holds the store,
    ends then too. A process killed hard says nothing: process 0 stands in for one whose count stood still
    (``start_answering``, ``_stand_in``); one on node 0 ends the store with it. Once a process: a second call does
    nothing. Nor does one process, a launcher without a store of its own (SLURM's ``srun``, Lightning's own), or
    one that restarts its processes (``--max-restarts``: the nodes count their attempts apart, so no key is sure to
    be this attempt's)."""
    from torch.distributed import DistNetworkError

    global _met
    if _met:
        return
    _met, timeout = True, timeout or _timeout
    try:
        store = _launch_store(min(timeout, timedelta(minutes=1)))  # the store is there (or gone) before then
        if store is not None:
            _meet(store, stopped, timeout)
    except DistNetworkError as error:
        raise LaunchError(
            f"the launcher's store ({os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}) is gone: node 0's "
            f"launcher ended, as a process there stopped; its output says why. ({_said(error)})"
        ) from None
    finally:
        _stop_answering()


def _meet(store, stopped: tuple[bool, str] | None, timeout: timedelta) -> None:
    rank, processes = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mine = json.dumps(None if stopped is None else [*stopped, where()])
    if store.compare_set(f"outcome/{rank}", "", mine).decode() != mine:  # process 0 stood in for this one
        if stopped is None:
            raise LaunchError(
                f"process 0 took this one as stopped: {SILENT.format(silence=_silence)}. Its count stood still "
                "(this process was paused, or starved of Python's GIL): raise SWIFTKV_START_SILENCE on node 0."
            )
        return
    said, counts = f"swiftkv distill: {stopped[1]}" if stopped else None, {}
    try:
        outcomes = _waited(store, "outcome", processes, timeout, said, counts)
    except LaunchError:
        with contextlib.suppress(Exception):  # a process that comes later does not wait for this one to hear
            store.set(f"heard/{rank}", "")
        raise
    stops = [(other, outcome) for other, outcome in enumerate(outcomes) if outcome is not None]
    if not stops:
        return
    # every process has the outcomes: a wait that fails now (process 0 left, and its store with it) changes nothing
    with contextlib.suppress(Exception):
        store.set(f"heard/{rank}", "")
        _waited(store, "heard", processes, timeout, said, counts)
    if stopped is None:
        other, told = stops[0]
        raise_stop(other, *told)


def raise_stop(rank: int, bad: bool, message: str, there: str) -> None:
    """Stop this process because process ``rank`` (``where`` it ran) stopped, with its reason: a ``ValueError``
    where that was bad input (``bad``), else a ``LaunchError``; the command prints either in one line."""
    raise (ValueError if bad else LaunchError)(
        f"process {rank} on {there} stopped, so this one does: {message}"
    )


# where launchers put a process's node rank: torchrun / fabric run, Lightning's own, SLURM
NODE_RANKS = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")


def where(node: int | None = None) -> str:
    """This process's node (its launcher's node rank, unless given) and host, as messages name it: node 1 (gpu-7)."""
    if node is None:
        node = int(next((os.environ[name] for name in NODE_RANKS if os.environ.get(name)), 0))
    return f"node {node} ({socket.gethostname()})"


def _launch_store(connect: timedelta):
    """The store of this process's ``torchrun`` launch (``fabric run``'s too), None where there is none; reached
    within ``connect`` (the calls made on it do not wait)."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if processes <= 1 or not agent_store or os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        return None
    from torch.distributed import PrefixStore, TCPStore

    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return PrefixStore("swiftkv/start", TCPStore(address, port, processes, is_master=False, timeout=connect))


def _waited(store, what: str, processes: int, timeout: timedelta, said: str | None, counts: dict) -> list:
    """Each process's ``what`` key, once all are set. Process 0 decides: it looks at them every ``POLL_SECONDS``,
    stands in for the silent ones meanwhile (``_stand_in``, ``counts`` kept between calls), and sets ``what/all``
    once all are set, or at its ``timeout`` to the processes still missing. The others look at that one key (a
    thousand processes each looking at a thousand keys a second would keep node 0's store busy), a minute longer.
    Looking, not a store's wait: one that runs out prints c10d's warnings. A process that stopped (``said``) says
    so first if that takes long."""
    keys = [f"{what}/{rank}" for rank in range(processes)]
    verdict, watch = f"{what}/all", os.environ["RANK"] == "0"
    start, limit = time.monotonic(), timeout if watch else timeout + timedelta(minutes=1)
    while not store.check(keys if watch else [verdict]):
        waited = timedelta(seconds=time.monotonic() - start)
        if waited >= limit:
            missing = [rank for rank, key in enumerate(keys) if not _has(store, key)]
            if watch:
                store.set(verdict, json.dumps(missing))
            raise _not_in_time(missing, what, timeout)
        if said is not None and waited >= QUIET_WAIT:
            print(f"{said} (waiting for the other processes to hear of it)", file=sys.stderr, flush=True)
            said = None
        if watch:
            _stand_in(store, what, keys, counts)
        time.sleep(POLL_SECONDS)
    if watch:
        store.set(verdict, "[]")
    elif missing := json.loads(store.get(verdict)):
        raise _not_in_time(missing, what, timeout)
    return [json.loads(value) if value else None for value in store.multi_get(keys)]


def _stand_in(store, what: str, keys: list[str], counts: dict) -> None:
    """Process 0's watch, while it waits for ``keys``: a process whose count (``beat``) stood still for ``_silence``
    since process 0 first saw it is taken as stopped, with the reason ``SILENT``, and as having heard, so that no
    one waits for it any longer: one that has not come, or one that came well and died waiting for the others (no
    one reads the outcomes before process 0 has them all). Every count is kept (``counts``: the count, and since
    when): a process killed after it came (its node's launcher ends the node's others as one ends) has stood still
    as long by the time the others wait for it to hear. A count never begun is a process not yet started (a node
    started late): the timeout waits for it."""
    now = time.monotonic()
    for rank, key in enumerate(keys):
        count = store.add(f"beat/{rank}", 0)
        if counts.get(rank, (None,))[0] != count:
            counts[rank] = (count, now)
            continue
        if not count or now - counts[rank][1] < _silence.total_seconds():
            continue
        if what == "heard":
            store.set(key, "")
            continue
        came = store.get(key).decode() if store.check([key]) else ""
        told = json.dumps([False, SILENT.format(silence=_silence), store.get(f"where/{rank}").decode()])
        if came in ("", "null") and store.compare_set(key, came, told).decode() == told:
            store.set(f"heard/{rank}", "")


def _not_in_time(missing: list[int], what: str, timeout: timedelta) -> LaunchError:
    named = "a process"
    if missing:
        named = f"process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    did = "reach the start of the run" if what == "outcome" else "hear of the stop"
    return LaunchError(
        f"{named} did not {did} within {timeout}: their node's output says why (a process killed "
        "before it started, or a node started late). trainer.strategy.timeout sets the wait."
    )


def _said(error: Exception) -> str:
    """The error's type and first line (c10d's go on with C++ frames)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def _has(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # the store is gone since: node 0's launcher ended
        return False
