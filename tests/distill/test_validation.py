"""Validation over several processes: every process runs as many batches (under FSDP2 each forward is a collective),
and the rows repeated to even them out are run but not scored, so the figures are one process's."""

import json
from types import SimpleNamespace

import pytest
import torch

from swiftkv_distill import DistillDataModule, SwiftKVDistillation
from swiftkv_distill.step import ValidationMetrics


@pytest.fixture
def distinct_file(tmp_path):
    """Held-out text whose packed rows all differ (a row is told by its tokens)."""
    path = tmp_path / "distinct.jsonl"
    lines = [
        {"text": f"Record {i}: the number {i * 37} is written as {i * 37:b} in binary."} for i in range(24)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _val_batches(dm, world: int, rank: int) -> list[dict]:
    dm.trainer = SimpleNamespace(world_size=world, global_rank=rank)
    return list(dm.val_dataloader())


def test_each_validation_row_is_scored_once_over_the_processes(tiny_model, text_file, distinct_file):
    dm = DistillDataModule(str(tiny_model), [str(text_file)], [str(distinct_file)], max_length=16, val_batch_size=2,
                           max_val_rows=7)  # fmt: skip
    dm.setup()
    rows = {tuple(row["input_ids"]) for row in dm.val_rows}
    assert len(dm.val_rows) == len(rows) == 7
    for world in (1, 2, 3, 4):
        scored, run = [], []
        for rank in range(world):
            batches = _val_batches(dm, world, rank)
            run.append(len(batches))
            for batch in batches:
                counted = batch.get("counted", torch.ones(len(batch["input_ids"]), dtype=torch.bool))
                for ids, real, scores in zip(batch["input_ids"], batch["token_mask"], counted, strict=True):
                    if scores:
                        scored.append(tuple(ids[real].tolist()))
        assert len(set(run)) == 1, (world, run)  # as many batches on every process
        assert sorted(scored) == sorted(rows), world  # each row once: none repeated, none lost


def test_validation_figures_over_processes_equal_one_process(tiny_model, text_file, distinct_file):
    """Two processes' metrics (the repeated row run by the second, summed as torchmetrics sums them over processes)
    equal one process's: before, the first row was scored twice."""
    dm = DistillDataModule(str(tiny_model), [str(text_file)], [str(distinct_file)], max_length=16, val_batch_size=2,
                           max_val_rows=3)  # fmt: skip
    dm.setup()
    module = SwiftKVDistillation(str(tiny_model), num_key_value_layers=2)
    module.configure_model()
    with torch.no_grad():  # a student that differs from its teacher
        for p in module.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    figures = []
    for world in (1, 2):
        metrics = ValidationMetrics()
        for rank in range(world):
            for batch in _val_batches(dm, world, rank):
                metrics.update(module.step.evaluate(batch))
        figures.append(metrics.compute())
    one, two = figures
    distilled = sum(sum(row.get("distilled", [True] * len(row["input_ids"]))) for row in dm.val_rows)
    assert one["tokens"] == two["tokens"] == distilled
    assert one.keys() == two.keys() and "student_ppl" in one
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)
