"""A training step queues its work on the device without waiting for it: no host read of a device value inside the
step's forward and backward (on a GPU each drains the device's queue: the host then waits, and the device waits for
the next launches), and, on several processes, one all-reduce of the step's metrics and none of Lightning's barriers.
Read through the operations the step runs (a dispatch mode: what would read a GPU tensor on the host) and the
collectives a real two-process run calls; the CPU runs the same code as a GPU."""

import json
import os
import traceback
from collections import Counter
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from swiftkv_core.weights import is_swiftkv_parameter
from swiftkv_distill.batches import collate, pack, row_wise
from swiftkv_distill.module import SwiftKVDistillation
from swiftkv_distill.step import AccumulationWindow
from tests.distill.test_distributed import ROOT, _config, _launch, _losses
from tests.flash_reference import flash_attention_2_on_the_reference

aten = torch.ops.aten
# operations whose result the host must read from the device: a value, or a shape that depends on the values
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.is_nonzero.default,
         aten.equal.default, aten.unique_consecutive.default, aten._unique2.default}  # fmt: skip
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class HostReads(TorchDispatchMode):
    """Where the work inside reads device values on the host: ``{(operation, the caller's file:line): count}``,
    the caller being the innermost frame outside torch. A boolean mask indexing a tensor reads its count."""

    def __init__(self):
        super().__init__()
        self.reads: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        read = func in READS or (
            func in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1])
        )
        if read:
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
            self.reads[(str(func), where)] += 1
        return func(*args, **kwargs or {})


def _ours(reads: Counter) -> dict:
    return {key: n for key, n in reads.items() if key[1].split(":")[0] in ("step.py", "loss.py", "module.py")}


def _module_and_batch(tiny_model, early_exit: bool) -> tuple[SwiftKVDistillation, dict]:
    """A step whose student differs from its teacher, and a collated batch of packed rows (3 sequences in 2 rows
    of 8, the last padded), where not every real token is distilled."""
    module = SwiftKVDistillation(
        str(tiny_model),
        num_key_value_layers=2,
        hidden_loss_weight=0.5,
        early_exit=early_exit,
        kv_init="published",
    )
    module.configure_model()
    with torch.no_grad():
        for name, p in module.swiftkv_model.named_parameters():
            if is_swiftkv_parameter(name):
                p.add_(0.05 * torch.randn_like(p))
    sequences = [[5, 17, 300, 42, 9, 8], [77, 1000, 3, 4, 5], [12, 13, 14, 15]]
    answers_only = [[False] * 2 + [True] * 4, [True] * 5, [False] * 3 + [True]]
    return module, collate(pack(sequences, max_length=8, distilled=answers_only), 0, 8)


@pytest.mark.parametrize("early_exit", [False, True])
def test_the_step_reads_nothing_from_the_device(tiny_model, early_exit):
    """The distillation step's forward and backward, on a collated batch of packed rows: the step's own code reads
    nothing (the distilled positions were found by the collate, on the host), nor does anything in the backward. The
    model's forward may read the positions to find the packed sequences (transformers' convention; with sdpa)."""
    module, batch = _module_and_batch(tiny_model, early_exit)
    with HostReads() as from_the_mask:  # without the collate's index, the step finds the positions itself
        expected = module.step(row_wise(batch), 0.1)
    assert ("aten.nonzero.default", "step.py") in {
        (op, where.split(":")[0]) for op, where in from_the_mask.reads
    }
    with HostReads() as forward:
        out = module.step(batch, 0.1)
    with HostReads() as backward:
        out["loss"].backward()
    assert out["tokens"] == batch["loss_mask"].sum() == len(batch["loss_index"]) == 10
    for name in expected:
        torch.testing.assert_close(out[name], expected[name], rtol=0, atol=0, msg=name)
    assert _ours(forward.reads) == {}, f"the step reads the device: {dict(forward.reads)}"
    assert dict(backward.reads) == {}, f"the backward reads the device: {dict(backward.reads)}"


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flash_attention_3"])
def test_with_flash_attn_nothing_in_the_step_reads_the_device(tiny_model, implementation):
    """With flash-attn the collate's variable-length arguments tell the model where the packed sequences start:
    nothing in the step's forward reads the device, the model's and transformers' code included (the reference
    kernels that stand in for flash-attn here aside), and the step computes what it computes when the model finds
    the sequences itself."""
    module, batch = _module_and_batch(tiny_model, early_exit=False)
    module.swiftkv_model.config._attn_implementation = implementation
    with flash_attention_2_on_the_reference() as calls:
        with HostReads() as finding:  # the model finds the sequences from the positions
            expected = module.step(row_wise(batch), 0.1)
        with HostReads() as forward:
            out = module.step(batch, 0.1)
    assert calls, "the flash-attn path did not run"
    finders = {where.split(":")[0] for _, where in finding.reads}
    assert {"modeling.py", "masking_utils.py"} <= finders, dict(finding.reads)
    reads = {key: n for key, n in forward.reads.items() if not key[1].startswith("flash_reference.py")}
    assert reads == {}, f"the forward reads the device: {reads}"
    for name in expected:
        torch.testing.assert_close(out[name], expected[name], rtol=0, atol=0, msg=name)


def test_a_windows_gradients_become_its_mean_without_a_read():
    """Gradient accumulation: the window's distilled positions are counted on the device, and the summed gradients
    divided by that count there, at the optimizer step (before: ``float(count)``, a read per step)."""
    window, param = AccumulationWindow(), torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), 16.0)  # two batches' gradients, summed
    with HostReads() as reads:
        for positions in (torch.tensor(3), torch.tensor(5)):  # each batch's, summed over the processes
            assert window.row_scale(positions, processes=1, window=2) == 2.0
        window.normalise([param])
    assert dict(reads.reads) == {}
    assert param.grad.tolist() == [2.0] * 3 and window.positions is None


class CountCollectives(L.Callback):
    """Counts the collectives each training batch calls (from its start to its end, the optimizer step included)
    and the real tokens this process trained on; written to ``collectives-RANK.json`` in ``folder`` at the end."""

    def __init__(self, folder: str):
        self.folder, self.calls, self.tokens = Path(folder), [], 0

    def setup(self, trainer, pl_module, stage):
        for name in ("all_reduce", "barrier"):
            real = getattr(torch.distributed, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                if self.calls and self.counting:
                    self.calls[-1][_name] += 1
                return _real(*args, **kwargs)

            setattr(torch.distributed, name, counted)
        self.counting = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls.append({"all_reduce": 0, "barrier": 0})
        self.tokens += int(batch["token_mask"].sum())
        self.counting = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counting = False
        report = {"calls": self.calls, "tokens": self.tokens, "tokens_seen": pl_module.tokens_seen}
        path = self.folder / f"collectives-{trainer.global_rank}.json"
        path.write_text(json.dumps(report))


@pytest.mark.distributed
def test_two_processes_sum_a_steps_metrics_in_one_all_reduce(tmp_path, tiny_model, text_file):
    """Two processes (DDP, gloo), rows of different lengths (not packed): each training batch calls two
    all-reduces (the distilled positions' count before the forward, the step's metrics and tokens after it) and no
    barrier; the gradients' own all-reduce is DDP's, in its reducer. The tokens seen are the processes' real tokens
    summed, exactly."""
    count = {
        "class_path": "tests.distill.test_host_waits.CountCollectives",
        "init_args": {"folder": str(tmp_path)},
    }
    config, out = _config(
        tmp_path, tiny_model, text_file, "ddp", batch_size=2, strategy="ddp", callbacks=[count],
        trainer={"max_steps": 3}, data={"pack": False, "max_length": 64}, model={"kv_init": "published", "compile_layers": False},
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    _launch(config, tmp_path, env=env)
    reports = [json.loads((tmp_path / f"collectives-{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report["calls"] == [{"all_reduce": 2, "barrier": 0}] * 3
    tokens = [report["tokens"] for report in reports]
    assert tokens[0] != tokens[1], "the test needs processes with different real tokens"
    assert reports[0]["tokens_seen"] == reports[1]["tokens_seen"] == sum(tokens)
    assert len(_losses(out)) == 3
