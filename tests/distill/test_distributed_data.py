"""The processes of a run on several nodes hold the same rows, or none trains: each node tokenises its own copy of
the data into its own token cache (two nodes of one process each, launched on this machine as on two, by
``fabric run --num_nodes 2``), and a failure on one process is raised on every one."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from swiftkv_distill.batches import check_same_rows
from swiftkv_distill.data import DataError
from swiftkv_distill.parallelize import gathered, on_every_process
from tests.conftest import free_port
from tests.distill.test_distributed import ROOT, _config, _fsdp2, _trained

HOST = socket.gethostname()


def _launch_nodes(
    configs,
    cwd,
    token_caches,
    timeout: float = 240,
    devices: int = 1,
    command: str = "fit",
    env=None,
    during=None,
) -> list[str]:
    """Node ``r`` runs ``configs[r]`` with the token cache ``token_caches[r]``, as ``fabric run --num_nodes N
    --node_rank r`` on each of N machines would (``devices`` processes each); each node's output (and its exit
    code) as it ended. ``during(port)``, where given, runs once the nodes started, ``port`` their launch's store's."""
    fabric, port = shutil.which("fabric", path=str(Path(sys.executable).parent)), free_port()
    nodes = []
    for rank, (config, cache) in enumerate(zip(configs, token_caches, strict=True)):
        node_env = {
            **os.environ,
            **(env or {}),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "SWIFTKV_TOKENS_DIR": str(cache),
        }
        launch = [fabric, "run", "--accelerator", "cpu", "--devices", str(devices), "--num_nodes", str(len(configs)),
                  "--node_rank", str(rank), "--main_address", "127.0.0.1", "--main_port", str(port),
                  str(ROOT / "apps" / "distill.py"), command, "--config", str(config)]  # fmt: skip
        log = Path(cwd) / f"{Path(config).stem}.log"  # a file, not a pipe: a node never waits for its reader
        with log.open("w") as output:
            node = subprocess.Popen(launch, env=node_env, cwd=cwd, stdout=output, stderr=subprocess.STDOUT)
        nodes.append((node, log))
    end = time.monotonic() + timeout
    try:
        if during is not None:
            during(port)
        for node, _ in nodes:
            node.wait(timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for node, _ in nodes:  # every node still running at the timeout (or at an error here) stopped
            if node.poll() is None:
                node.terminate()  # the launcher stops its workers (sessions of their own), killing them after 30 s
                try:
                    node.wait(90)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.wait()
    return [f"exit {node.returncode}\n{log.read_text()}" for node, log in nodes]


def _nodes(tmp_path, tiny_model, name, data_files) -> list[Path]:
    """Two nodes' configs of one run, each reading its own copy of the data (``data_files[r]``): one step."""
    configs = []
    for rank, data in enumerate(data_files):
        config, _ = _config(
            tmp_path, tiny_model, data, f"{name}-node{rank}", 2, _fsdp2(timeout="0:01:00"),
            trainer={"num_nodes": 2, "devices": 1, "max_steps": 1},
            model={"compile_layers": False, "kv_init": "published"},
        )  # fmt: skip
        configs.append(config)
    return configs


@pytest.mark.distributed
def test_nodes_whose_copies_of_the_data_make_other_rows_are_refused_on_both(tmp_path, tiny_model, text_file):
    """Node 1's copy of the data file has one word for another (as many rows, other tokens): each node would train
    on other data, silently. Both nodes refuse, naming each one's rows, before a weight is read. Node 1's token
    cache unwritable: its failure to make the rows stops node 0 too, with its reason (before, node 0 failed on a
    lost connection over gloo, and NCCL may wait for the timeout). The same text copied to each node, tokenised
    there into its own cache, trains."""
    copies = [tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"]
    shutil.copy(text_file, copies[0])
    copies[1].write_text(text_file.read_text().replace("Tuesday", "Monday"))
    caches = [tmp_path / "tokens0", tmp_path / "tokens1"]
    outputs = _launch_nodes(_nodes(tmp_path, tiny_model, "edited", copies), tmp_path, caches)
    refusal = (
        r"The processes hold other rows \(process 0 on node 0 \(\S+\): (\d+) training and (\d+) validation rows "
        r"\(digest (\w{12})\); process 1 on node 1 \(\S+\): \1 training and \2 validation rows \(digest "
        r"(?!\3)\w{12}\)\)\. A node with its own token cache"
    )
    for output in outputs:
        assert output.startswith("exit 1\n"), output
        assert len(list(re.finditer(refusal, " ".join(output.split())))) == 1, output
        assert "Loading weights" not in output, output
    assert not list(tmp_path.glob("edited-node*/export"))

    shutil.copy(text_file, copies[1])  # the same text again, to be tokenised again into node 1's own cache
    (tmp_path / "a-file").touch()
    unwritable = [caches[0], tmp_path / "a-file" / "tokens"]  # node 1's "folder" is under a file
    outputs = _launch_nodes(_nodes(tmp_path, tiny_model, "unwritable", copies), tmp_path, unwritable)
    stopped = f"The token cache {unwritable[1]} cannot be written"
    assert outputs[1].startswith("exit 1\n") and f"swiftkv distill: {stopped}" in outputs[1], outputs[1]
    assert outputs[0].startswith("exit 1\n"), outputs[0]
    said = f"swiftkv distill: process 1 on node 1 ({HOST}) stopped, so this one does: DataError: {stopped}"
    assert said in outputs[0], outputs[0]

    outputs = _launch_nodes(_nodes(tmp_path, tiny_model, "same", copies), tmp_path, caches)
    assert all(output.startswith("exit 0\n") for output in outputs), outputs
    assert "Loading weights" in outputs[0]  # where the refused runs stopped before it
    assert _trained(tmp_path / "same-node0")


def test_the_refusal_names_each_group_of_processes_and_what_it_holds():
    """Eight processes on two nodes: the second's four made fewer rows (their data files are shorter); then the
    same rows, and one process with another batch size (its command line); then both, and another trainer setting
    (each node's process of a ``fabric run`` per node)."""

    def held(node: int, training: int, digest: str, batch_size: int = 4) -> dict:
        return {"where": f"node {node} (gpu)", "training": training, "validation": 10, "digest": digest * 64,
                "settings": {"data.max_length": 512, "data.batch_size": batch_size,
                             "trainer.accumulate_grad_batches": 1}}  # fmt: skip

    check_same_rows([held(0, 100, "f")] * 4 + [held(1, 100, "f")] * 4)
    with pytest.raises(DataError) as refused:
        check_same_rows([held(0, 100, "f")] * 4 + [held(1, 98, "e")] * 3 + [held(0, 100, "f")])
    assert str(refused.value).startswith(
        "The processes hold other rows (processes 0-3, 7 on node 0 (gpu): 100 training and 10 validation rows "
        "(digest ffffffffffff); processes 4-6 on node 1 (gpu): 98 training and 10 validation rows (digest "
        "eeeeeeeeeeee)). A node with its own token cache tokenises its own copy"
    )
    with pytest.raises(DataError) as refused:
        check_same_rows([held(0, 100, "f")] * 4 + [held(1, 100, "f")] * 3 + [held(1, 100, "f", 8)])
    assert str(refused.value).startswith(
        "The processes hold other settings (processes 0-6 on node 0 (gpu), node 1 (gpu): 100 training and 10 "
        "validation rows (digest ffffffffffff), data.batch_size 4; process 7 on node 1 (gpu): 100 training and 10 "
        "validation rows (digest ffffffffffff), data.batch_size 8). Each node reads them from its own command: give "
        "every node the same settings. Otherwise"
    )
    with pytest.raises(
        DataError, match=r"other rows or settings \(process 0 on node 0 \(gpu\): 100 training"
    ):
        check_same_rows([held(0, 100, "f"), held(1, 98, "e", 8)])
    accumulating = held(1, 100, "f")
    accumulating["settings"]["trainer.accumulate_grad_batches"] = 8
    with pytest.raises(
        DataError, match=r"; process 1 on node 1 \(gpu\): 100 .*, trainer\.accumulate_grad_batches 8\)"
    ):
        check_same_rows([held(0, 100, "f"), accumulating])


def _process(rank: int, port: int, results) -> None:
    """One of two processes: ``on_every_process`` where no process fails, then where process 0 does, then 1."""
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))  # fmt: skip
    for fails in (None, 0, 1):

        def work(fails=fails) -> int:
            if rank == fails:
                raise DataError(f"no rows on process {rank}")
            return rank * 10

        start = time.monotonic()
        try:
            results[fails, rank] = ("returned", gathered(on_every_process(work)))
        except Exception as error:
            results[fails, rank] = (type(error).__name__, str(error))
        results["seconds", fails, rank] = time.monotonic() - start
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_failure_on_one_process_is_raised_on_every_one():
    """Two real processes (gloo): what each returned, in rank order; or, where one failed, its error raised there
    and named on the other (bad input stays a ValueError), at once, not at the process group's timeout."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_process, args=(free_port(), results), nprocs=2)
        results = dict(results)
    seconds = [value for key, value in results.items() if key[0] == "seconds"]
    assert len(seconds) == 6 and max(seconds) < 30  # each call: not the process group's timeout (300 s)
    assert results[None, 0] == results[None, 1] == ("returned", [0, 10])
    for fails in (0, 1):
        assert results[fails, fails] == ("DataError", f"no rows on process {fails}")
        assert results[fails, 1 - fails] == (
            "ValueError",
            f"process {fails} on node 0 ({HOST}) stopped, so this one does: DataError: no rows on process {fails}",
        )  # fmt: skip
