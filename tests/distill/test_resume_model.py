"""A checkpoint holds the trained weights alone, and a resume reads the frozen ones from the model again: the model
a checkpoint was trained from is recorded in it by content, a resume from another model is refused, and the same
model in another folder resumes."""

import shutil
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from safetensors.torch import load_file, save_file

from swiftkv_core.checkpoints import model_identity
from swiftkv_distill.build import check_same_run
from tests.distill.runs import fit


class Steps(L.Callback):
    """Counts the batches this run trained (a step each here)."""

    trained = 0

    def on_train_batch_end(self, *args) -> None:
        self.trained += 1


def _fit(model, text_file, root, max_steps, ckpt_path=None) -> int:
    """The steps a run of ``model`` trained to ``max_steps`` (from ``ckpt_path``'s, where given)."""
    fit(model, text_file, root, max_steps, ckpt_path=ckpt_path, extra_callbacks=[steps := Steps()])
    return steps.trained


# each run is longer than the one before: its schedule too, which a resume warns of
@pytest.mark.filterwarnings("ignore:the run resumed at step")
def test_a_resume_refuses_another_model_and_takes_the_same_one_moved(tmp_path, tiny_model, text_file):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    assert _fit(model, text_file, tmp_path / "run", max_steps=2) == 2
    last = tmp_path / "run" / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["model_identity"]["path"] == str(model.resolve())
    assert set(saved["model_identity"]["weight_files"]) == {"model.safetensors"}

    # the same files in another folder (as copied to a node's disk): the run goes on from step 2
    moved = shutil.copytree(model, tmp_path / "moved")
    assert _fit(moved, text_file, tmp_path / "run", max_steps=3, ckpt_path=last) == 1

    # one frozen weight changed in place (a model trained again, a re-download of another revision): refused
    weights = load_file(moved / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] += 1.0
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"moved is not the model the checkpoint was trained from: model.safetensors differs"
    ):
        _fit(moved, text_file, tmp_path / "run", max_steps=4, ckpt_path=last)


def test_the_datas_model_may_move_only_with_the_runs_model(tmp_path, tiny_model):
    """The data module's ``model`` (its tokenizer) moved with the run's model is the same run; moved elsewhere, it is
    a changed setting, as without a recorded model."""
    model = shutil.copytree(tiny_model, tmp_path / "model")
    moved, other = shutil.copytree(model, tmp_path / "moved"), shutil.copytree(model, tmp_path / "other")
    saved = {"model_identity": model_identity(model), "hyper_parameters": {"model": str(model)},
             "datamodule_hyper_parameters": {"model": str(model)}}  # fmt: skip

    def data(path):
        return SimpleNamespace(hparams={"model": str(path)}, state_dict=lambda trainer: {})

    check_same_run(saved, {"model": str(moved)}, data(moved))
    with pytest.raises(ValueError, match=r"other settings \(data\.model '.*/model' -> '.*/other'\)"):
        check_same_run(saved, {"model": str(moved)}, data(other))
