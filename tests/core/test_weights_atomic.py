"""The one definition of SwiftKV weight names, atomic writes, and the teacher/student switch."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from swiftkv_core.atomic import atomic_directory, atomic_file, made_once
from swiftkv_core.convert import convert
from swiftkv_core.weights import (
    is_swiftkv_parameter,
    is_teacher_projection,
    layer_index,
    match_swiftkv_kv,
    swiftkv_parameter_names,
)
from tests.conftest import tiny_base
from tests.processes import readline


def test_weight_names():
    assert is_swiftkv_parameter("model.norm_swiftkv.weight")
    assert is_swiftkv_parameter("step.model.model.layers.3.self_attn.q_proj_swiftkv.bias")  # prefixed
    assert not is_swiftkv_parameter("model.layers.3.self_attn.q_proj.weight")
    assert not is_swiftkv_parameter("model.swiftkv_notes")
    assert is_teacher_projection("model.layers.3.self_attn.k_proj.weight", 2)
    assert not is_teacher_projection("model.layers.1.self_attn.k_proj.weight", 2)  # layers < l keep theirs
    assert not is_teacher_projection("model.layers.3.self_attn.o_proj.weight", 2)
    assert not is_teacher_projection("model.layers.3.self_attn.k_proj_swiftkv.weight", 2)
    assert match_swiftkv_kv("model.layers.12.self_attn.v_proj_swiftkv.bias") == (12, "v", "bias")
    assert match_swiftkv_kv("model.layers.12.self_attn.q_proj_swiftkv.weight") is None
    assert layer_index("model.layers.7.mlp.up_proj.weight") == 7 and layer_index("lm_head.weight") is None


@pytest.mark.parametrize("g", [1, 2])
def test_swiftkv_parameters_are_exactly_the_added_ones(family, g):
    base = tiny_base(family)
    model = convert(tiny_base(family), 2, g)
    added = set(model.state_dict()) - set(base.state_dict())
    assert set(swiftkv_parameter_names(model)) == added and added


def _write(folder, text):
    (folder / "a.txt").write_text(text)


def test_atomic_directory_replaces_only_on_success(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as staging:
        _write(staging, "first")
    assert (target / "a.txt").read_text() == "first"
    with pytest.raises(RuntimeError, match="disk full"), atomic_directory(target) as staging:
        _write(staging, "half")
        raise RuntimeError("disk full")
    assert (target / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left behind


def test_a_live_writers_staging_folder_is_left_alone_and_a_killed_ones_cleared(tmp_path):
    """Two processes writing the same folder: the later one leaves the earlier one's staging folder alone while that
    process lives (it holds a lock on it), and clears it once the process is killed."""
    target = tmp_path / "out"
    code = (
        "import sys; from swiftkv_core.atomic import atomic_directory\n"
        "with atomic_directory(sys.argv[1]) as staging:\n    (staging / 'a.txt').write_text('other')"
    )
    env = {**os.environ, "SWIFTKV_PAUSE_AT": "atomic-directory"}  # it stops with its folder staged, not moved
    other = subprocess.Popen(
        [sys.executable, "-c", code, str(target)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert readline(other.stderr).startswith("SWIFTKV_PAUSED atomic-directory")
        (theirs,) = tmp_path.glob(".out.staging.*")
        os.utime(theirs, (0, 0))  # old enough to be taken for abandoned, were it not locked
        with atomic_directory(target) as staging:
            _write(staging, "mine")
        assert (target / "a.txt").read_text() == "mine" and (theirs / "a.txt").read_text() == "other"
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    with atomic_directory(target) as staging:  # the writer is gone: its folder is cleared
        _write(staging, "again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_writer_killed_between_its_two_moves_loses_nothing(tmp_path):
    """A real process SIGKILLed inside ``replace_directory``, its old folder set aside and the new one not yet in
    place: the next write puts the old one back first, so even a write that then fails leaves it there."""
    target = tmp_path / "out"
    with atomic_directory(target) as staging:
        _write(staging, "first")
    code = (
        "import sys; from swiftkv_core.atomic import atomic_directory\n"
        "with atomic_directory(sys.argv[1]) as staging:\n    (staging / 'a.txt').write_text('killed')"
    )
    env = {**os.environ, "SWIFTKV_PAUSE_AT": "replace-directory"}
    other = subprocess.Popen(
        [sys.executable, "-c", code, str(target)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert readline(other.stderr).startswith("SWIFTKV_PAUSED replace-directory")
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    # the window this test is about: the old folder set aside, the new one not in place
    assert not target.exists() and len(list(tmp_path.glob(".out.old.*"))) == 1
    with pytest.raises(RuntimeError, match="disk full"), atomic_directory(target) as staging:
        raise RuntimeError("disk full")
    assert (target / "a.txt").read_text() == "first"
    (killed,) = tmp_path.glob(".out.staging.*")
    os.utime(killed, (0, 0))  # old enough to be taken for abandoned (it is: no process holds its lock)
    with atomic_directory(target) as staging:
        _write(staging, "second")
    assert (target / "a.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_directory_works_where_the_file_system_has_no_locks(tmp_path, monkeypatch):
    """Some network file systems refuse ``flock`` (ENOLCK): the write goes on, and a cache's folder is made once
    (``made_once``). A staging folder is cleared by its age alone, once nothing in it changed for a day: a live
    writer's growing file keeps it. The refusal is made here (this machine's file systems all lock)."""
    import errno

    from swiftkv_core import atomic

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(atomic.fcntl, "flock", no_locks)
    old, growing = tmp_path / ".out.staging.abandoned", tmp_path / ".out.staging.growing"
    for folder in (old, growing):
        folder.mkdir()
        for name in ("rows.npy", atomic.CLAIM):
            (folder / name).write_text("")
            os.utime(folder / name, (0, 0))
        os.utime(folder, (0, 0))
    (growing / "rows.npy").write_text("written now")
    with atomic_directory(tmp_path / "out") as staging:
        _write(staging, "first")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.staging.growing", "out"]
    made = []
    for _ in range(2):
        made_once(tmp_path / "cache", lambda folder: folder.is_dir(), lambda staging: made.append(staging))
    assert len(made) == 1 and (tmp_path / "cache").is_dir()


def test_a_free_lock_is_trusted_on_its_own_host_only(tmp_path):
    """NFS mounted ``local_lock`` keeps each node's locks to itself: a staging folder claimed on another host, its
    lock free here, is deleted only once nothing in it changed for a day. One claimed on this host is deleted once
    its lock is free."""
    import socket

    from swiftkv_core.atomic import CLAIM

    folders = {}
    for name, host, written_now in (("here", socket.gethostname(), True), ("there", "node-7", True),
                                    ("there-long-ago", "node-7", False)):  # fmt: skip
        folder = folders[name] = tmp_path / f".out.staging.{name}"
        folder.mkdir()
        (folder / CLAIM).write_text(host)
        (folder / "rows.npy").write_text("")
        for path in [folder / CLAIM, folder] + ([] if written_now else [folder / "rows.npy"]):
            os.utime(path, (0, 0))
    with atomic_directory(tmp_path / "out") as staging:
        _write(staging, "first")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.staging.there", "out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.txt"]  # no claim left in place


def test_atomic_directory_keeps_the_old_folder_if_the_final_move_fails(tmp_path, monkeypatch):
    target = tmp_path / "out"
    with atomic_directory(target) as staging:
        _write(staging, "first")
    real_replace, calls = os.replace, []

    def failing_second_move(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # 1: the old folder aside, 2: the new one into place
            raise OSError("interrupted")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_second_move)
    with pytest.raises(OSError, match="interrupted"), atomic_directory(target) as staging:
        _write(staging, "second")
    monkeypatch.undo()
    assert (target / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_file(tmp_path):
    path = tmp_path / "data.jsonl"
    with atomic_file(path) as f:
        f.write("one\n")
    with pytest.raises(KeyboardInterrupt), atomic_file(path) as f:
        f.write("two\n")
        raise KeyboardInterrupt
    assert path.read_text() == "one\n" and [p.name for p in tmp_path.iterdir()] == ["data.jsonl"]


def test_atomic_writes_reach_the_disk_before_their_rename_and_the_rename_after(tmp_path, monkeypatch):
    """A crash of the machine (power loss) after a rename keeps the rename only with what it names flushed: each
    file and folder of the new checkpoint is flushed before it goes in place, and its parent folder after."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src, dst):
        events.append(("replace", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    with atomic_directory(tmp_path / "out") as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "model.safetensors").write_bytes(b"weights")
    with atomic_file(tmp_path / "state.json") as f:
        f.write("{}")
    into_place = [i for i, (kind, path) in enumerate(events) if kind == "replace"]
    assert [events[i][1] for i in into_place] == [str(tmp_path / "out"), str(tmp_path / "state.json")], events
    synced_before = {os.path.basename(path) for kind, path in events[: into_place[0]] if kind == "fsync"}
    assert {"model.safetensors", "sub"} <= synced_before, events
    assert events[into_place[0] + 1] == events[into_place[1] + 1] == ("fsync", str(tmp_path)), events
    assert events[into_place[1] - 1][0] == "fsync" and ".state.json." in events[into_place[1] - 1][1], events


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_get_the_permissions_of_a_plain_write(tmp_path, umask):
    """A folder or file written atomically has the mode mkdir/open would give it under the umask, not the private
    0o700/0o600 of a temporary one (a checkpoint written by a container's user stays readable on the host)."""
    previous = os.umask(umask)
    try:
        with atomic_directory(tmp_path / "checkpoint") as staging:
            _write(staging, "weights")
            save_file({"w": torch.zeros(2)}, staging / "model.safetensors")  # safetensors 0.8 writes it 0o600
        with atomic_file(tmp_path / "report.md") as f:
            f.write("report\n")
        assert os.umask(umask) == umask  # the writes left the umask as they found it
        (tmp_path / "plain-folder").mkdir()
        (tmp_path / "plain-file").write_text("x")
    finally:
        os.umask(previous)

    def mode(name: str) -> int:
        return (tmp_path / name).stat().st_mode & 0o777

    assert mode("checkpoint") == mode("plain-folder") == 0o777 & ~umask
    assert mode("report.md") == mode("plain-file") == mode("checkpoint/model.safetensors") == 0o666 & ~umask


@torch.no_grad()
def test_swiftkv_mode_restores_also_on_errors(family):
    model = convert(tiny_base(family), 2)
    ids = torch.randint(0, 128, (1, 8))
    with model.swiftkv_mode(False):
        assert not model.config.swiftkv
        teacher = model(ids).logits
    assert model.config.swiftkv
    torch.testing.assert_close(teacher, tiny_base(family)(ids).logits)
    with pytest.raises(RuntimeError, match="boom"), model.swiftkv_mode(False):
        raise RuntimeError("boom")
    assert model.config.swiftkv


def test_swiftkv_mode_goes_through_the_checks(tmp_path):
    from transformers import AutoModelForCausalLM

    from swiftkv_core.convert import export_for_serving

    export_for_serving(convert(tiny_base("llama"), 2), tmp_path / "serve")
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "serve")
    with pytest.raises(ValueError, match="serving export"), served.swiftkv_mode(False):
        pass
    assert served.config.swiftkv


def test_a_model_trained_again_in_place_is_another_model(tmp_path):
    """Fine-tuning in place keeps the weight files' sizes: the identity that keys the teacher's cached answers and
    a quickstart run's results changes all the same (digests of samples of the bytes), or they would be reused
    stale. The same bytes written again (a cache made anew) are the same model."""
    from swiftkv_core.checkpoints import model_identity

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    weights = tmp_path / "model.safetensors"
    shard = torch.randn(3 << 20)  # 12 MiB: sampled, not read whole
    save_file({"w": shard}, weights)
    before = model_identity(tmp_path)
    save_file({"w": shard}, weights)  # written again: a new modification time
    assert model_identity(tmp_path) == before
    save_file({"w": shard + 1e-3}, weights)  # trained again: the same size
    after = model_identity(tmp_path)
    assert after["weight_files"]["model.safetensors"]["bytes"] == weights.stat().st_size
    assert after != before


def _as_another_user(function) -> None:
    """``function()`` run as the user ``nobody`` in a forked child (the caller is root); the test fails if it raises
    (its traceback printed) or hangs."""
    import time
    import traceback

    child = os.fork()
    if child == 0:  # pragma: no cover (the child's exit code is the result)
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            function()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (status := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if status[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the other user's write hung")
    assert os.waitstatus_to_exitcode(status[1]) == 0, "the other user's write failed (its traceback above)"


def test_another_users_read_only_lock_file_does_not_stop_a_write():
    """A cache shared by a team: the lock file another user's run left is read-only for this one (the other's
    umask). The cache is still made, without taking turns (as where there are no locks), instead of failing. As
    root, the other user is real (a forked child that becomes ``nobody``); otherwise this user's own read-only lock
    file stands for the other's."""
    import shutil
    import tempfile
    from pathlib import Path

    shared = Path(tempfile.mkdtemp())  # not under tmp_path: its parents are private to root
    try:
        shared.chmod(0o777)
        (shared / ".cache.lock").touch(mode=0o444)

        def make():
            made_once(shared / "cache", lambda folder: folder.is_dir(), lambda staging: _write(staging, "x"))

        if os.geteuid() == 0:
            _as_another_user(make)
        else:
            make()
        assert (shared / "cache" / "a.txt").read_text() == "x"
    finally:
        shutil.rmtree(shared)
