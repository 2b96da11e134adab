"""A ``child_main`` child for tests/serve/test_orphans.py: it starts a process of its own (in its group, as vLLM
starts its engine core) and waits, as an engine child does while it generates."""

from __future__ import annotations

import subprocess
import sys
import time

from swiftkv_serve.child import child_main


def start_a_process_and_wait(seconds: float) -> dict:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("started", flush=True)
    time.sleep(seconds)
    return {}


if __name__ == "__main__":
    child_main(start_a_process_and_wait, *sys.argv[1:])
