"""A ``child_main`` child for tests/serve/test_orphans.py: it starts a process of its own (in its group, as vLLM
starts its engine core) and waits, as an engine child does while it generates: in Python, or in native code that
does not come back (a lock taken twice), as an engine's start or a forward may be for many seconds; then the
process it started ignores SIGTERM, as an engine process stuck in native code does in effect."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time

from swiftkv_serve.child import child_main


def start_a_process_and_wait(seconds: float, native: bool = False) -> dict:
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if native else ""
    subprocess.Popen([sys.executable, "-c", f"import signal, time; {ignore}time.sleep(600)"])
    print("started", flush=True)
    if native:
        libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)
        libc.pthread_mutex_init(mutex, None)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # a normal mutex locked again by its owner: blocks for good
    time.sleep(seconds)
    return {}


if __name__ == "__main__":
    child_main(start_a_process_and_wait, *sys.argv[1:])
