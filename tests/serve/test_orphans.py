"""A run killed for real leaves no engine or server behind. Our vLLM engines and servers run in a session of their
own, which a terminal's Ctrl-C and hangup do not reach; before ``tied_to_this_process``, a run ended by SIGKILL,
SIGTERM or a closed terminal left its engine generating on (on a GPU, holding most of the GPU's memory) and its
server answering. Each test starts a real parent process, waits until its child is at work, SIGKILLs the parent
and waits for every process of the child's group to end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from swiftkv_serve.server import free_port
from tests.processes import children_of, group_members, readline

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {timeout_s:.0f} s")


def kill_parent_and_expect_group_gone(parent: subprocess.Popen, group: int, timeout_s: float = 30) -> None:
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + timeout_s
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_members(group), f"left behind: {group_members(group)}"
    finally:  # whatever the outcome, nothing of this test outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


@pytest.mark.vllm
def test_a_killed_runs_vllm_answer_child_ends_with_it(tiny_llama, tmp_path):
    """The teacher-answers child (swiftkv_serve.answers, vLLM's engine in the child itself, as the main job's first
    stage runs it) ends when the process that started it is killed with SIGKILL. Killed while it starts its engine:
    the kernel's signal does not depend on what the child is doing, and waiting for answers costs vLLM's whole
    start (2-3 minutes of the suite on 2 cores)."""
    script = textwrap.dedent(
        """
        import sys
        from swiftkv_serve.answers import generate_answers
        generate_answers(sys.argv[1], ["Tell me a story."] * 400, max_new_tokens=128, seed=0)
        """
    )
    log = tmp_path / "parent.log"
    parent = subprocess.Popen([sys.executable, "-c", script, str(tiny_llama)], stderr=log.open("w"))
    try:
        child = wait_for(lambda: children_of(parent.pid), 60, "child process")[0]
        # the launcher has become the answers module, importing vLLM
        wait_for(lambda: "swiftkv_serve.answers" in Path(f"/proc/{child}/cmdline").read_text(), 10, "exec")
        time.sleep(5)
    except BaseException:
        parent.kill()
        raise
    assert parent.poll() is None and group_members(child), log.read_text()[-2000:]
    kill_parent_and_expect_group_gone(parent, child)


@pytest.mark.parametrize("native", [False, True], ids=["in-python", "in-native-code"])
def test_a_killed_runs_child_ends_with_the_processes_it_started(tmp_path, native):
    """A ``run_module_in_child`` child that started a process of its own, as vLLM's engine core is one under the
    main job's serving stage: when the run is killed with SIGKILL, the child ends its whole group, also while its
    main thread is in native code that does not come back (where a Python signal handler would never run), and
    the process it started ignores SIGTERM (ended by the SIGKILL after the child's 10 s grace)."""
    script = textwrap.dedent(
        f"""
        from swiftkv_serve.child import run_module_in_child
        spec = {{"seconds": 600, "native": {native}}}
        run_module_in_child("tests.serve.orphan_child", spec, "a child", lambda line: print(line, flush=True))
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert readline(parent.stdout).strip() == "started"
    child = children_of(parent.pid)[0]
    assert len(group_members(child)) == 2  # the child and the process it started
    kill_parent_and_expect_group_gone(parent, child, timeout_s=20 if native else 10)


HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
"""


def test_a_killed_runs_server_ends_with_it(tmp_path):
    """A server started by ``running_server`` (the soak benchmark's, the tests') ends when the process that
    started it is killed with SIGKILL: the launcher has the kernel send it SIGTERM, what vLLM's server stops on."""
    port = free_port()
    script = textwrap.dedent(
        f"""
        import sys, time
        from swiftkv_serve.server import running_server
        command = [sys.executable, "-c", {HEALTH_SERVER!r}, "--port", "{port}"]
        with running_server(command, {str(tmp_path / "server.log")!r}) as (base, proc):
            print(proc.pid, flush=True)
            time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server = int(readline(parent.stdout))
    assert group_members(server) == [server]  # up, answering /health, alone in its group
    kill_parent_and_expect_group_gone(parent, server, timeout_s=10)
