"""Sharded (FSDP2) runs resumed as a cluster launches them (``fabric run`` on 2 CPU processes): from a one-file
checkpoint, and refused, before any weight is read, from the run's own last checkpoint where it was another l."""

import pytest
import torch

from tests.distill.test_distributed import _config, _fsdp2, _launch, _losses, _trained


@pytest.mark.distributed
def test_a_sharded_run_resumes_from_a_one_file_checkpoint(tmp_path, tiny_model, text_file):
    """ModelParallelStrategy(save_distributed_checkpoint=False): rank 0 writes one file of the trained weights, which
    Lightning loads into the shards parameter by parameter (wanting each frozen one too where loading is strict):
    the run resumed from step 2 trains steps 3 and 4 to the uninterrupted run's weights."""
    strategy = _fsdp2()
    strategy["init_args"]["save_distributed_checkpoint"] = False
    ckpt_dir, eager = tmp_path / "ckpt", {"model": {"compile_layers": False}}
    run_cfg, run_out = _config(tmp_path, tiny_model, text_file, "run", 2, strategy, ckpt_dir, **eager)
    _launch(run_cfg, tmp_path)
    (step2,) = ckpt_dir.glob("*step=2.ckpt")
    assert step2.is_file()
    saved = torch.load(step2, weights_only=False)["state_dict"]
    assert set(saved) == {f"step.model.{k}" for k in _trained(run_out)}
    resume_cfg, resume_out = _config(tmp_path, tiny_model, text_file, "resumed", 2, strategy, **eager)
    _launch(resume_cfg, tmp_path, "--ckpt_path", str(step2))
    assert _losses(resume_out) == _losses(run_out)[2:]
    resumed = _trained(resume_out)
    for name, value in _trained(run_out).items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.distributed
def test_a_resume_of_last_with_another_l_is_refused_before_a_weight_is_read(tmp_path, tiny_model, text_file):
    """``--ckpt_path last`` (Lightning's name for the run's own last checkpoint) is checked as a path is: a sharded
    run of another l is refused with the setting that changed before the model is built (it was refused only as
    Lightning restored the checkpoint, once rank 0 had read every weight: minutes for a 70B)."""
    strategy, ckpt_dir = _fsdp2(timeout="0:02:00"), tmp_path / "ckpt"
    last = {"class_path": "swiftkv_distill.checkpointing.ModelCheckpoint",
            "init_args": {"dirpath": str(ckpt_dir), "save_last": True, "save_top_k": 0}}  # fmt: skip
    eager, checkpointing = {"compile_layers": False, "kv_init": "published"}, {"enable_checkpointing": True}
    config, _ = _config(
        tmp_path, tiny_model, text_file, "run", 2, strategy, trainer=checkpointing | {"max_steps": 1},
        model=eager, callbacks=[last],
    )  # fmt: skip
    _launch(config, tmp_path)
    assert (ckpt_dir / "last.ckpt").is_dir()  # a distributed checkpoint: a folder of shards
    fails = {"class_path": "tests.distill.test_distributed.LoadFails", "init_args": {"rank0": True}}
    config, out = _config(
        tmp_path, tiny_model, text_file, "other-l", 2, strategy, trainer=checkpointing | {"max_steps": 2},
        model=eager | {"num_key_value_layers": 3}, callbacks=[last, fails],
    )  # fmt: skip
    result = _launch(config, tmp_path, "--ckpt_path", "last", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "may not load the model" not in output, output
    assert "model.num_key_value_layers 2 -> 3" in output, output
    assert not (out / "export").exists()
