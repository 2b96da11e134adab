"""An OpenAI-compatible server as a process of its own (``swiftkv-serve CHECKPOINT ...``): started, waited for
until ``/health`` answers, and ended with everything it started, in every case. The soak benchmark and the tests
drive servers through it, as users do: over HTTP on loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from .child import terminate_group, tied_to_this_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def swiftkv_serve_command(checkpoint: str | Path, port: int, *options: str) -> list[str]:
    """``swiftkv-serve CHECKPOINT --host 127.0.0.1 --port PORT OPTIONS`` (this environment's console script)."""
    executable = Path(sys.executable).parent / "swiftkv-serve"
    return [str(executable), str(checkpoint), "--host", "127.0.0.1", "--port", str(port), *options]


class ServerFailed(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log."""


@contextlib.contextmanager
def running_server(
    command: list[str], log: Path, env: dict | None = None, timeout_s: float = 300
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start ``command`` (its output to ``log``), wait for ``/health`` on the ``--port`` it names, yield the base
    URL and the process; the server and its children are ended afterwards (SIGTERM, then SIGKILL)."""
    port = command[command.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        # SIGTERM when this process ends, however it ends: vLLM's server then stops its engine
        proc = subprocess.Popen(
            tied_to_this_process(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout_s
        # ours exited first, then the port's /health: a server that took the port after free_port let it go
        # answers there too, and an exited process's port is never taken for its server
        while proc.poll() is None and not healthy(base):
            if time.monotonic() > deadline:
                raise ServerFailed(f"{' '.join(command)}: no /health after {timeout_s:.0f} s:\n{tail(log)}")
            time.sleep(0.5)
        if proc.poll() is not None:
            raise ServerFailed(f"{' '.join(command)} exited with {proc.returncode}:\n{tail(log)}")
        yield base, proc
    finally:
        terminate_group(proc, grace_s=30)


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:])


def process_tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    total, stack = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while stack:
        current = stack.pop()
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((Path("/proc") / str(current) / "statm").read_text().split()[1]) * page
        stack.extend(children.get(current, []))
    return total
