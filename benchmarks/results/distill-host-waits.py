"""Where one training batch reads device values on the host (each read drains a GPU's queue), in a real Lightning
fit on the CPU: a tiny random Llama (4 layers, l = 2), packed rows of 32 tokens, batches of 2, the third batch
watched from its start to its end (forward, backward, optimizer step). Counted by tests/distill/test_host_waits.py's
HostReads (the operations whose result the host must read). Usage, from the repository root:
PYTHONPATH=. python benchmarks/results/distill-host-waits.py"""

import tempfile
from collections import Counter
from pathlib import Path

import lightning as L

from swiftkv_distill.datamodule import DistillDataModule
from swiftkv_distill.module import SwiftKVDistillation
from tests.distill.conftest import TEXTS, quiet_trainer, tiny_llama, write_jsonl
from tests.distill.test_host_waits import HostReads


class Watch(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            self.mode = HostReads().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            self.mode.__exit__(None, None, None)
            by_file = Counter()
            for (operation, where), count in sorted(self.mode.reads.items(), key=lambda item: item[0][1]):
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
trainer = quiet_trainer(folder, max_steps=3, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Watch()])
trainer.fit(module, data)
