"""Host memory of flex_attention's kept-rows block mask (``swiftkv_core.modeling._kept_rows_block_mask``), built as the
model builds it (compiled) and as it was built before (``create_block_mask`` eager, which first builds the dense
rows x keys mask): the growth of this process's peak RSS while one mask is built, after a warm-up at a small shape
(the compile). Rows of packed 1024-token sequences and a random half of the positions kept, as a distillation step
with ``position_fraction: 0.5`` asks. Usage: python flex-kept-rows-mask-memory.py compiled|eager ROWS TOKENS"""

import resource
import sys
from types import SimpleNamespace

import torch

from swiftkv_core import modeling

mode, rows, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "eager":
    modeling.torch.compile = lambda function: function  # the code before: create_block_mask called as it is


def build(length: int):
    positions = (torch.arange(length) % 1024)[None].expand(rows, -1)  # packed sequences of 1024 tokens
    mask_kwargs = dict(config=SimpleNamespace(_attn_implementation="flex_attention"), attention_mask=None,
                       inputs_embeds=torch.empty(rows, length, 1), past_key_values=None, position_ids=positions)  # fmt: skip
    keep = torch.randperm(length, generator=torch.Generator().manual_seed(0))[: length // 2].sort().values
    return modeling._kept_rows_mask(mask_kwargs, None, keep, plain=False, attention_kwargs={})


build(256)  # warm-up: the compile, at a shape too small to matter
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mask = build(tokens)
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(
    f"{mode}: {rows} x {tokens} tokens, {tokens // 2} kept per row: peak RSS +{grown:.0f} MiB ({mask.shape})"
)
