"""Processes as Linux's /proc shows them, for the tests that kill real processes and check what outlives them. A
zombie (ended, not yet reaped: an orphan's may stay one in a container) counts as ended."""

from __future__ import annotations

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
