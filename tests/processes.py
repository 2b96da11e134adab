"""Processes as Linux's /proc shows them, for the tests that kill real processes and check what outlives them (a
zombie, ended, not yet reaped: an orphan's may stay one in a container, counts as ended), and their output read
with a time limit."""

from __future__ import annotations

import threading
import time
from pathlib import Path


def running(pid: int) -> tuple[int, int] | None:
    """``(parent, process group)`` of process ``pid`` while it runs, else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[2]))


def _running_processes() -> dict[int, tuple[int, int]]:
    found = {int(entry.name): running(int(entry.name)) for entry in Path("/proc").glob("[0-9]*")}
    return {pid: stat for pid, stat in found.items() if stat is not None}


def children_of(pid: int) -> list[int]:
    return [child for child, (parent, _) in _running_processes().items() if parent == pid]


def group_members(group: int) -> list[int]:
    return [member for member, (_, its_group) in _running_processes().items() if its_group == group]


def readline(stream, timeout: float = 120.0) -> str:
    """``stream.readline()`` of a child's pipe, failing the test after ``timeout`` seconds instead of hanging the
    suite on a child that stopped without a word ("" at the pipe's end, as readline). A thread reads it: a pipe's
    text wrapper may already hold lines a ``select`` on its descriptor would not see."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert line, f"no line from the child in {timeout:.0f} s"
    return line[0]


def lines(stream, timeout: float):
    """The lines of a child's pipe to its end, failing the test once ``timeout`` seconds have passed in all."""
    deadline = time.monotonic() + timeout
    while line := readline(stream, max(deadline - time.monotonic(), 0.0)):
        yield line
