"""Where one training batch reads device values on the host (each read drains a GPU's queue), in a real Lightning
fit on the CPU: a tiny random Llama (4 layers, l = 2), packed rows of 32 tokens, batches of 2, the third batch
watched from its start to its end (forward, backward, optimizer step). Counted by tests/distill/test_host_waits.py's
HostReads (the operations whose result the host must read). Usage, from the repository root:
PYTHONPATH=. python benchmarks/results/distill-host-waits.py [--attention flash_attention_2] [--accumulate 2]
(flash-attn's path runs tests/flash_reference.py's kernels, whose own reads are left out: flash-attn's are on the
device; --accumulate: gradients accumulated over that many batches, the window's last batch watched)."""

import argparse
import contextlib
import tempfile
from collections import Counter
from pathlib import Path

import lightning as L

from swiftkv_distill.datamodule import DistillDataModule
from swiftkv_distill.module import SwiftKVDistillation
from tests.distill.conftest import TEXTS, quiet_trainer, tiny_llama, write_jsonl
from tests.distill.test_host_waits import HostReads
from tests.flash_reference import flash_attention_2_on_the_reference

parser = argparse.ArgumentParser()
parser.add_argument("--attention", default="sdpa")
parser.add_argument("--accumulate", type=int, default=1)
args = parser.parse_args()
WATCHED = 3 * args.accumulate - 1  # the third optimizer step's last batch


class Watch(L.Callback):
    def on_train_start(self, trainer, pl_module):  # by name, flash-attn would be refused in fp32
        pl_module.swiftkv_model.config._attn_implementation = args.attention

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == WATCHED:
            self.mode = HostReads().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == WATCHED:
            self.mode.__exit__(None, None, None)
            by_file = Counter()
            for (operation, where), count in sorted(self.mode.reads.items(), key=lambda item: item[0][1]):
                if where.startswith("flash_reference.py"):
                    continue
                print(f"{count} x {operation} at {where}")
                by_file[where.split(":")[0]] += count
            print("by file:", dict(by_file))


folder = Path(tempfile.mkdtemp())
model = tiny_llama(folder / "llama")
text = write_jsonl(folder / "text.jsonl", [{"text": t} for t in TEXTS])
module = SwiftKVDistillation(
    str(model), num_key_value_layers=2, kv_init="published", evaluate_before_training=False
)
data = DistillDataModule(str(model), [str(text)], max_length=32, batch_size=2)
trainer = quiet_trainer(
    folder, max_steps=3, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Watch()],
    accumulate_grad_batches=args.accumulate,
)  # fmt: skip
flash = args.attention.startswith("flash")
with flash_attention_2_on_the_reference() if flash else contextlib.nullcontext():
    trainer.fit(module, data)
