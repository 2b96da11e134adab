"""Running a module in a child process and getting its JSON result back: one engine per process, so its memory,
threads and compile state are its own and end with it.

``run_module_in_child("pkg.module", spec, what)`` runs ``python -m pkg.module SPEC.json RESULT.json``; the module
ends with ``child_main(function)``, which calls ``function(**spec)`` and writes its result. A failure raises
``ChildProcessFailed`` with the child's error lines; the child and everything it started are ended in every case,
this process's own end included, however it comes (``tied_to_this_process``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path


class ChildProcessFailed(RuntimeError):
    """A child process (one model's benchmark, an answer generation) failed; the message has its error lines."""


def error_lines(log: str, limit: int = 8000) -> str:
    """The lines of a child's log that say what went wrong (else its last 40 lines)."""
    lines = log.splitlines()
    errors = [line for line in lines if "ERROR" in line or "Error" in line or "error:" in line]
    return "\n".join(errors or lines[-40:])[-limit:]


def terminate_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """End the child and whatever it started (vLLM's engine-core process), by the child's process group:
    SIGTERM, then SIGKILL for what is still there after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()  # reaps the child once it exits
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def tied_to_this_process(command: list[str], signal_number: int = signal.SIGTERM) -> list[str]:
    """``command`` started through a launcher that has ``signal_number`` sent to it when this process ends, however
    it ends (Linux's ``PR_SET_PDEATHSIG``, kept across the launcher's ``exec`` into the command). Our engines
    and servers run in a session of their own, which a terminal's Ctrl-C and hangup do not reach: before this, a
    run killed by SIGKILL, SIGTERM or a closed terminal left its vLLM engine answering on, holding its memory (on a
    GPU, most of the GPU's) and its port. Start it from the thread that waits for it. Elsewhere: ``command``."""
    if sys.platform != "linux":
        return command
    return [sys.executable, "-m", "swiftkv_serve.child", str(os.getpid()), str(int(signal_number)), *command]


def run_module_in_child(
    module: str,
    spec: dict,
    what: str,
    on_line: Callable[[str], None] | None = None,
    env_overrides: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> tuple[object, str]:
    """Run ``python -m module SPEC.json RESULT.json`` in a child process (its own session) and return the
    JSON it wrote and its log (stdout + stderr). The child's engine sizes its KV cache itself
    (``kv_cache_memory_bytes``), so ``VLLM_CPU_KVCACHE_SPACE``, which would override that on CPU, is removed from
    its environment; ``env_overrides`` are added.

    ``on_line`` gets each line the child prints on stdout, while it runs. Raises ``ChildProcessFailed`` with
    the child's error lines when it exits with an error, writes no result, or runs past ``timeout_s``; the child
    and what it started are ended in every case.
    """
    on_line = on_line or (lambda line: None)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"} | (env_overrides or {})
    with tempfile.TemporaryDirectory(prefix="swiftkv-child-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        # Output to files, not pipes: an engine process left behind holding a pipe open cannot block us.
        stdout_path, stderr_path = Path(tmp) / "stdout.log", Path(tmp) / "stderr.log"
        with stdout_path.open("w") as stdout, stderr_path.open("w") as stderr:
            # SIGHUP when this process ends, until child_main watches for that itself; either way the child's whole
            # group (its engine processes) ends with this process
            command = [sys.executable, "-m", module, str(spec_path), str(result_path)]
            proc = subprocess.Popen(
                tied_to_this_process(command, signal.SIGHUP),
                stdout=stdout,
                stderr=stderr,
                env=env,
                start_new_session=True,
            )
            start, seen = time.monotonic(), 0
            try:
                while proc.poll() is None:
                    time.sleep(1)
                    seen = _new_lines(stdout_path, seen, on_line)
                    if timeout_s is not None and time.monotonic() - start > timeout_s:
                        break
            finally:
                timed_out = proc.poll() is None
                terminate_group(proc)
        _new_lines(stdout_path, seen, on_line)
        log = stdout_path.read_text(errors="replace") + stderr_path.read_text(errors="replace")
        if timed_out or proc.returncode or not result_path.is_file():
            why = f"ran past {timeout_s} s" if timed_out else f"exit {proc.returncode}"
            raise ChildProcessFailed(f"{what} failed ({why}):\n{error_lines(log)}")
        return json.loads(result_path.read_text()), log


def _new_lines(stdout_path: Path, seen: int, on_line: Callable[[str], None]) -> int:
    text = stdout_path.read_text(errors="replace")
    complete = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]  # whole lines only
    for line in complete[seen:]:
        on_line(line)
    return max(seen, len(complete))


def child_main(function: Callable[..., object], spec_file: str, result_file: str) -> None:
    """The child side of ``run_module_in_child``: ``function(**spec)`` with the settings in ``spec_file`` (JSON),
    its JSON-able result written to ``result_file`` (atomically: no file means it failed)."""
    from swiftkv_core.atomic import atomic_file

    if os.getpgrp() == os.getpid():  # the leader of its own group, as run_module_in_child starts it
        # Until here the parent's end (tied_to_this_process's SIGHUP) ends this process, which has started nothing
        # yet. From here a thread watches for it and ends the group, the engine processes included: a signal
        # handler runs only once the main thread comes back from native code (an engine's start, a forward), which
        # may be long after.
        parent = os.getppid()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        threading.Thread(target=_end_group_when_gone, args=(parent,), daemon=True).start()
    result = function(**json.loads(Path(spec_file).read_text()))
    with atomic_file(Path(result_file)) as f:
        f.write(json.dumps(result, ensure_ascii=False))


def _end_group_when_gone(parent: int, grace_s: float = 10) -> None:
    """Once ``parent`` has ended: SIGTERM to the rest of this process's group, then SIGKILL to the whole group
    after ``grace_s`` (or once the rest has ended), as ``terminate_group`` does from the parent's side. Not
    ``killpg(SIGTERM)``: it would end this process first, and with it the SIGKILL for an engine process that
    does not stop on SIGTERM (one stuck in native code)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    for pid in _rest_of_group():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _rest_of_group() and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(0, signal.SIGKILL)


def _rest_of_group() -> list[int]:
    """The running processes of this process's group but this one, from Linux's /proc (zombies left out)."""
    me, group, rest = os.getpid(), os.getpgrp(), []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, _, its_group = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[:3]
            if int(its_group) == group and int(entry.name) != me and state != "Z":
                rest.append(int(entry.name))
    return rest


if __name__ == "__main__":  # tied_to_this_process's launcher (Linux): PARENT_PID SIGNAL COMMAND...
    # (no swiftkv_core import here: it takes transformers and torch, seconds, before every engine and server)
    import ctypes

    ctypes.CDLL(None).prctl(1, int(sys.argv[2]))  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):  # the parent ended before that
        sys.exit(1)
    os.execvp(sys.argv[3], sys.argv[3:])
