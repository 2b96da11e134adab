"""Peak tensor memory of the validation statistics (swiftkv_distill.loss.eval_stats) of one chunk of 512 distilled
positions with a bf16 LM head of Llama-3.1-8B's shape (128,256 x 4,096; ``frozen_dtype: bfloat16``), on the CPU
(swiftkv_core.runtime.PeakMemory: what a GPU's allocator would count). Usage: python eval-head-memory.py"""

import time

import torch

from swiftkv_core.runtime import PeakMemory
from swiftkv_distill.loss import eval_stats

torch.manual_seed(0)
vocab, hidden, positions = 128_256, 4_096, 512
head = (torch.randn(vocab, hidden) / hidden**0.5).bfloat16()
student, teacher = torch.randn(positions, hidden), torch.randn(positions, hidden)
labels = torch.randint(0, vocab, (positions,))
started = time.perf_counter()
with PeakMemory("cpu", resident=[head, student, teacher, labels]) as meter:
    stats = eval_stats(student, teacher, head, labels, chunk_size=512)
seconds = time.perf_counter() - started
held = meter.peak_bytes - meter.resident_bytes
print(
    f"bf16 head {head.numel() * 2 / 2**30:.2f} GiB; one chunk's fp32 logits {positions * vocab * 4 / 2**30:.2f} GiB"
)
print(f"eval_stats held at most {held / 2**30:.2f} GiB on top of its inputs ({seconds:.1f} s on this CPU)")
print(f"mean KL {stats.kl.mean():.4f}, agreement {stats.agree.float().mean():.4f}")
