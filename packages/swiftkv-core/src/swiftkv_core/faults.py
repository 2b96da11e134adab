"""Named points where a fault test stops a real process to kill it there (failpoints, as etcd's gofail or TiKV's
fail-rs): with ``SWIFTKV_PAUSE_AT=NAME`` (and ``SWIFTKV_PAUSE_AFTER=N``: at the N-th time the point is reached,
default the first) the process prints ``SWIFTKV_PAUSED NAME`` on stderr and waits there until it is killed.
Without the variable a point does nothing. ``tests/integration/test_kill.py`` uses them to SIGKILL a training run in
the middle of a checkpoint, an export or a state write, and checks that nothing half-written is ever read back.
"""

from __future__ import annotations

import os
import sys
import time

_reached: dict[str, int] = {}


def pause_point(name: str) -> None:
    """Stop here for good if ``$SWIFTKV_PAUSE_AT`` names this point (see the module docstring)."""
    if os.environ.get("SWIFTKV_PAUSE_AT") != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] != int(os.environ.get("SWIFTKV_PAUSE_AFTER", "1")):
        return
    print(f"SWIFTKV_PAUSED {name}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)
