"""The processes of a ``fabric run`` / ``torchrun`` launch meet once before the process group exists
(``launch.meet_at_start``): a process that stops before the run starts (a path, a setting or a checkpoint its node
lacks) stops every other one with its reason, at once, where they waited for the process group's timeout (30 min by
default) to fail on the store's "wait timeout", naming no reason."""

import os
import re
import shutil
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.multiprocessing as mp
import yaml
from torch.distributed import PrefixStore, TCPStore

from swiftkv_distill import launch
from tests.conftest import free_port
from tests.distill.test_distributed import _config, _fsdp2
from tests.distill.test_distributed_data import _launch_nodes, _nodes

HOST = socket.gethostname()
# each case: what each of the three processes does (None: comes well, a string: stops with it, "away": never
# starts, "killed": starts, then is killed before it comes, "stalls": its count stands still, then it comes, "late":
# comes once process 2 was taken as stopped, "dies waiting": comes well, then is killed), and how long the meeting
# waits
CASES = [
    ((None, None, None), 5),
    ((None, "ValueError: no such model folder", None), 5),
    (("ValueError: no such checkpoint", None, "RuntimeError: out of host memory"), 5),
    ((None, None, "away"), 5),
    ((None, None, "stalls"), 120),
    ((None, None, "killed"), 120),  # the last: the process is gone
]
DIES_WAITING = [((None, "late", "dies waiting"), 120)]


def _until(happened, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not happened():
        assert time.monotonic() < end, "it never happened"
        time.sleep(0.1)


def _process(rank: int, cases: list, ports: list[int], results) -> None:
    """Process ``rank`` of three, each case a launch of its own, whose launcher's store this test holds."""
    os.environ |= {"RANK": str(rank), "WORLD_SIZE": "3", "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0",
                   "SWIFTKV_START_SILENCE": "5"}  # fmt: skip
    for case, (does, timeout) in enumerate(cases):
        os.environ["MASTER_PORT"] = str(ports[case])
        launch._met, launch._answering = False, None
        if does[rank] == "away":
            continue
        launch.start_answering()
        if does[rank] == "killed":  # as the out-of-memory killer would, before it says a word
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        store = launch._launch_store(timedelta(seconds=10))
        if does[rank] == "stalls":  # as a process paused (SIGSTOP, a debugger) until process 0 stands in
            _until(lambda store=store: store.add(f"beat/{rank}", 0) > 0)
            launch._stop_answering()
            _until(lambda store=store: store.check([f"outcome/{rank}"]))
        if does[rank] == "late":  # as a node started late would
            _until(lambda store=store: store.check(["outcome/2"]) and store.get("outcome/2") != b"null")
        if does[rank] == "dies waiting":  # as the out-of-memory killer would, or a node lost
            threading.Timer(1, os.kill, (os.getpid(), signal.SIGKILL)).start()
        stopped = (
            None
            if does[rank] in (None, "stalls", "late", "dies waiting")
            else (does[rank].startswith("ValueError"), does[rank])
        )
        began = time.monotonic()
        try:
            launch.meet_at_start(stopped, timeout=timedelta(seconds=timeout))
            results[case, rank] = "returned"
        except Exception as error:
            results[case, rank] = f"{type(error).__name__}: {error}"
        results[case, rank, "seconds"] = time.monotonic() - began
        launch.meet_at_start(None, timeout=timedelta(seconds=timeout))  # a second call (the command's): none


@pytest.mark.distributed
def test_every_process_hears_of_a_stop_before_the_run_starts():
    """Three real processes meet through a real store: all come well and go on; one stops with bad input and the
    others stop with its reason (a ValueError, printed in one line); two stop and the others name the first; one
    never starts and the others say so at the timeout, naming it; one is killed (SIGKILL) as it starts, and the
    others stop once its count has stood still for SWIFTKV_START_SILENCE (5 s), long before the timeout (120 s);
    one whose count stood still that long comes after all, and is told that it was taken as stopped. Then one comes
    well and is killed as it waits for another, which comes late: the others stop as well, naming it."""
    exits, results = _meetings(CASES)
    assert exits == [0, 0, -signal.SIGKILL]
    assert [results[0, rank] for rank in range(3)] == ["returned"] * 3
    stop = f"process 1 on node 1 ({HOST}) stopped, so this one does: ValueError: no such model folder"
    assert [results[1, rank] for rank in range(3)] == [
        f"ValueError: {stop}",
        "returned",
        f"ValueError: {stop}",
    ]
    stop = f"process 0 on node 0 ({HOST}) stopped, so this one does: ValueError: no such checkpoint"
    assert [results[2, rank] for rank in range(3)] == ["returned", f"ValueError: {stop}", "returned"]
    for rank in (0, 1):
        assert re.fullmatch(
            r"LaunchError: process 2 did not reach the start of the run within 0:00:05: their node's output says "
            r"why \(a process killed before it started, or a node started late\)\. trainer\.strategy\.timeout "
            r"sets the wait\.",
            results[3, rank],
        ), results[3, rank]
    assert (3, 2) not in results
    silent = f"LaunchError: process 2 on node 2 ({HOST}) stopped, so this one does: " + launch.SILENT.format(
        silence=timedelta(seconds=5)
    )
    assert [results[5, rank] for rank in (0, 1)] == [silent, silent]
    assert max(results[5, rank, "seconds"] for rank in (0, 1)) < 30
    assert [results[4, rank] for rank in (0, 1)] == [silent, silent]
    assert results[4, 2].startswith(
        "LaunchError: process 0 took this one as stopped: no word from it for 0:00:05"
    )
    exits, results = _meetings(DIES_WAITING)
    assert exits == [0, 0, -signal.SIGKILL]
    assert [results[0, rank] for rank in (0, 1)] == [silent, silent]


def _meetings(cases: list) -> tuple[list[int], dict]:
    """Three processes meeting in each of ``cases``: their exit codes, and what each meeting gave each one."""
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in cases]
    spawn = mp.get_context("spawn")
    with mp.Manager() as manager:
        results = manager.dict()
        processes = [
            spawn.Process(target=_process, args=(rank, cases, [store.port for store in stores], results))
            for rank in range(3)
        ]
        try:
            for process in processes:
                process.start()
            for process in processes:
                process.join(300)
        finally:
            for process in processes:  # none left behind, should a meeting hang
                if process.is_alive():
                    process.kill()
        return [process.exitcode for process in processes], dict(results)


@pytest.mark.distributed
def test_a_node_that_stops_before_the_run_starts_stops_the_other_with_its_reason(
    tmp_path, tiny_model, text_file
):
    """Two nodes, each a ``fabric run --num_nodes 2`` on this machine, the process group's timeout 10 minutes. Node
    1's model folder is not there: node 0 stops too, naming node 1's reason (before, it waited out the timeout).
    Node 0, whose launcher holds the store, lacks the checkpoint to resume from: node 1 still hears why."""
    copies = [tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"]
    for copy in copies:
        shutil.copy(text_file, copy)
    caches = [tmp_path / "tokens0", tmp_path / "tokens1"]
    for stops, change in ((1, {"model": {"model": str(tmp_path / "no-model")}}),
                          (0, {"ckpt_path": str(tmp_path / "no-checkpoint.ckpt")})):  # fmt: skip
        configs = _nodes(tmp_path, tiny_model, f"stops-{stops}", copies)
        for config in configs:
            settings = yaml.safe_load(config.read_text())
            settings["trainer"]["strategy"]["init_args"]["timeout"] = "0:10:00"
            if config is configs[stops]:
                settings["model"] |= change.get("model", {})
                settings |= {key: value for key, value in change.items() if key != "model"}
            config.write_text(yaml.safe_dump(settings))
        outputs = _launch_nodes(configs, tmp_path, caches, timeout=240)
        reasons = re.findall(r"^swiftkv distill: (.*)$", outputs[stops], re.MULTILINE)
        assert outputs[stops].startswith("exit 1\n") and reasons, outputs[stops]
        other = outputs[1 - stops]
        assert other.startswith("exit 1\n"), other
        said = (rf"swiftkv distill: process {stops} on node {stops} \({re.escape(HOST)}\) stopped, so this one does: "
                rf"\w+Error: {re.escape(reasons[-1])}")  # fmt: skip
        assert re.search(said, other), other
        assert "Loading weights" not in other


@pytest.mark.distributed
def test_a_process_killed_as_it_starts_stops_the_others_with_word_of_it(tmp_path, tiny_model, text_file):
    """Two nodes of two processes, each node a ``fabric run --num_nodes 2 --devices 2`` on this machine, the process
    group's timeout 10 minutes. Process 3 (node 1) is killed (SIGKILL, as the out-of-memory killer would) while it
    reads its checkpoint to resume from (a named pipe that never gives a byte), after process 2 on its node came to
    the meeting: it says nothing, and its node's launcher ends process 2 too, as it waits. Node 0's processes stop
    once node 1's counts stood still for SWIFTKV_START_SILENCE (5 s), naming one of node 1's processes (they went
    silent together; node 1's output names the one killed), without waiting for process 2 to hear of it; before,
    they waited for the process group's timeout."""
    copies = [tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"]
    for copy in copies:
        shutil.copy(text_file, copy)
    caches = [tmp_path / "tokens0", tmp_path / "tokens1"]
    configs = _nodes(tmp_path, tiny_model, "killed", copies)
    os.mkfifo(tmp_path / "slow.ckpt")
    for node, config in enumerate(configs):
        settings = yaml.safe_load(config.read_text())
        settings["trainer"]["devices"] = 2
        settings["trainer"]["strategy"]["init_args"] |= {"data_parallel_size": 4, "timeout": "0:10:00"}
        if node == 1:  # each process reads its own from its environment: process 3 alone the pipe
            settings["ckpt_path"] = "${oc.env:SWIFTKV_TEST_CKPT_${oc.env:LOCAL_RANK},null}"
        config.write_text(yaml.safe_dump(settings))
    killed = []

    def kill_process_3(port: int) -> None:
        """Once process 3 answers, and process 2 came to the meeting, kill process 3: it is still reading the pipe."""
        store = PrefixStore(
            "swiftkv/start", TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=2))
        )
        # process 0 makes the count's key as it looks: wait for a count
        _until(lambda: store.add("beat/3", 0) > 0 and store.check(["outcome/2"]), seconds=120)
        workers = [
            pid for pid, env in _processes() if f"SWIFTKV_TOKENS_DIR={caches[1]}" in env and "RANK=3" in env
        ]
        assert len(workers) == 1 and not store.check(["outcome/3"]), workers
        os.kill(workers[0], signal.SIGKILL)
        killed.append(time.monotonic())

    env = {"SWIFTKV_START_SILENCE": "5", "SWIFTKV_TEST_CKPT_1": str(tmp_path / "slow.ckpt")}
    outputs = _launch_nodes(configs, tmp_path, caches, devices=2, env=env, during=kill_process_3)
    assert killed and outputs[1].startswith("exit 1\n") and "Signal 9 (SIGKILL)" in outputs[1], outputs[1]
    assert outputs[0].startswith("exit 1\n"), outputs[0]
    said = rf"\nswiftkv distill: process [23] on node 1 \({HOST}\) stopped, so this one does: " + re.escape(
        launch.SILENT.format(silence=timedelta(seconds=5))
    )
    # both of node 0's processes, each in one line: its traceback would say nothing of the cause
    assert len(re.findall(said, outputs[0])) == 2 and "swiftkv_distill/launch.py" not in outputs[0], outputs[
        0
    ]
    assert time.monotonic() - killed[0] < 60


def _processes():
    """Each process of this machine that this test may read, with its environment's entries."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                yield (
                    int(entry.name),
                    (Path(entry.path) / "environ").read_bytes().decode(errors="replace").split("\0"),
                )
            except OSError:  # ended since, or another user's
                continue


@pytest.mark.distributed
def test_validate_on_two_processes_of_a_node_stops_both_when_one_stops(tmp_path, tiny_model, text_file):
    """``validate`` meets too (``fit`` meets after its own checks): one ``fabric run --devices 2`` on this node
    validates the model's weights, its output free of Lightning's advice; then process 1 alone is given a
    checkpoint that is not there (each process reads its path from its own environment). Lightning would open it
    only once the process group exists: process 1 refuses it before the meeting, and process 0 stops with its
    reason, where it would wait for process 1 until the timeout."""
    config, _ = _config(
        tmp_path, tiny_model, text_file, "validate", 2, _fsdp2(timeout="0:10:00"),
        model={"compile_layers": False, "kv_init": "published"}, trainer={"limit_val_batches": 2},
    )  # fmt: skip
    settings = yaml.safe_load(config.read_text())
    config.write_text(
        yaml.safe_dump(settings | {"ckpt_path": "${oc.env:SWIFTKV_TEST_CKPT_${oc.env:LOCAL_RANK},null}"})
    )
    (output,) = _launch_nodes([config], tmp_path, [tmp_path / "tokens"], devices=2, command="validate")
    assert output.startswith("exit 0\n") and re.search(r"val/agreement +│ +0\.\d+", output), output
    # the metrics are summed over the processes: no advice to sync them
    assert "sync_dist" not in output, output
    # process 0 is given none (the model's weights)
    paths = {"SWIFTKV_TEST_CKPT_1": str(tmp_path / "no-checkpoint.ckpt")}
    (output,) = _launch_nodes(
        [config], tmp_path, [tmp_path / "tokens"], devices=2, command="validate", env=paths
    )
    assert output.startswith("exit 1\n"), output
    refused = f"--ckpt_path {paths['SWIFTKV_TEST_CKPT_1']}: no checkpoint there. Give a Lightning checkpoint"
    assert re.search(rf"swiftkv distill: process 1 on node 0 \({re.escape(HOST)}\) stopped, so this one does: "
                     rf"FileNotFoundError: {re.escape(refused)}", output), output  # fmt: skip
    assert f"swiftkv distill: {refused}" in output, output


def test_no_meeting_where_the_launch_has_no_store_of_its_own(monkeypatch):
    """One process, a launcher without a store before the process group (SLURM's ``srun``, Lightning's own), or a
    ``torchrun --max-restarts`` (its nodes count their attempts apart): ``meet_at_start`` returns at once, without
    reaching for a store (here none listens at MASTER_PORT, which would fail after the timeout), and a process does
    not answer (``start_answering``)."""
    monkeypatch.setattr(launch, "_silence", launch.SILENCE)
    agent = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
             "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}  # fmt: skip
    for change in (
        {"WORLD_SIZE": "1"},
        {"TORCHELASTIC_USE_AGENT_STORE": ""},
        {"TORCHELASTIC_MAX_RESTARTS": "3"},
    ):
        for name, value in (agent | change).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(launch, "_met", False)
        start = time.monotonic()
        launch.start_answering()
        assert launch._answering is None, change
        launch.meet_at_start((True, "ValueError: a bad setting"), timeout=timedelta(seconds=20))
        assert time.monotonic() - start < 10, change
    monkeypatch.setattr(launch, "_met", False)
    for name, value in agent.items():
        monkeypatch.setenv(name, value)
    # the same, under torchrun: the store is reached for, and is not there
    with pytest.raises(launch.LaunchError, match=r"the launcher's store \(127\.0\.0\.1:\d+\) is gone"):
        launch.meet_at_start((True, "ValueError: a bad setting"), timeout=timedelta(seconds=2))


def test_a_start_silence_that_is_not_seconds_is_refused(monkeypatch):
    """SWIFTKV_START_SILENCE is refused, with the fix, as the process starts: not a number of seconds, or under 3."""
    monkeypatch.setattr(launch, "_silence", launch.SILENCE)
    for value in ("soon", "1", "-5", "inf", "nan"):
        monkeypatch.setenv("SWIFTKV_START_SILENCE", value)
        with pytest.raises(
            ValueError, match=rf"^SWIFTKV_START_SILENCE is '{value}': give the seconds .*\(default 180\)"
        ):
            launch.start_answering()
        assert launch._silence == launch.SILENCE
