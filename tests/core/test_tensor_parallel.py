"""Two CPU processes (gloo) load SwiftKV checkpoints with transformers' tensor-parallel plan
(``DistributedConfig(tp_plan="auto")``, launched by ``torchrun``): each holds its share of every layer's heads, the
projections SwiftKV adds included, and the logits of a prefill's kept rows and of the next token equal one process's;
a checkpoint with LoRA adapters, which the plan does not split, is refused with the way out (its serving export)."""

import subprocess
import sys
from pathlib import Path

import torch

from swiftkv_core import convert, save_checkpoint
from tests.conftest import free_port, tiny_base
from tests.core.tensor_parallel_worker import logits

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")


def _randomised(model):
    """``model`` with its SwiftKV weights drawn at random: after ``convert`` they copy the teacher's, which would
    hide a projection split the wrong way."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "swiftkv" in name and parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    return model


def test_tensor_parallel_swiftkv_matches_one_process(tmp_path):
    models = {
        "llama": convert(tiny_base("llama"), 2),
        "llama-acrosskv": convert(tiny_base("llama"), 2, 2),
        "qwen2": convert(tiny_base("qwen2"), 2),
        "llama-lora": convert(tiny_base("llama"), 2).add_lora(4),
    }
    expected = {}
    for name, model in models.items():
        _randomised(model.eval())
        save_checkpoint(model, tmp_path / name)
        expected[name] = logits(model)
    # the LoRA model's serving export (adapters merged) is what loads with the plan
    save_checkpoint(models["llama-lora"], tmp_path / "llama-lora-serving", serving=True)
    expected["llama-lora-serving"] = expected["llama-lora"]
    folders = [str(tmp_path / name) for name in expected]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
    ]
    command += ["--master_port", str(free_port()), str(WORKER), *folders]
    subprocess.run(command, check=True, timeout=300, cwd=Path(__file__).parents[2])
    for name, reference in expected.items():
        result = torch.load(tmp_path / name / "tensor_parallel.pt")
        if name == "llama-lora":
            assert "rank-4 adapters" in result["error"] and "export_for_serving" in result["error"]
            continue
        assert result.get("tp_size") == 2, (name, result)
        for part in ("prefill", "next"):
            torch.testing.assert_close(
                result[part], reference[part], atol=1e-5, rtol=1e-4, msg=f"{name} {part}"
            )
