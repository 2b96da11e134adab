"""Peak tensor memory of one prefill (with KV cache, last-position logits, as generate runs it), SwiftKV off and on,
on the CPU (swiftkv_core.runtime.PeakMemory: what a GPU's allocator would count). A tiny random Llama (4 layers,
l = 2), so the prompt-length terms (masks, activations) dominate. Usage: python prefill-mask-memory.py TOKENS [padded]
(padded: a batch of two prompts, the first left-padded by 8 tokens, as generate pads a batch)"""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from swiftkv_core.convert import convert
from swiftkv_core.runtime import PeakMemory

tokens = int(sys.argv[1])
padded = sys.argv[2:] == ["padded"]
torch.manual_seed(0)
shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
base = LlamaForCausalLM(
    LlamaConfig(vocab_size=128, num_hidden_layers=4, max_position_embeddings=tokens, **shape)
)
model = convert(base.eval(), 2, 1)
model.config._attn_implementation = "sdpa"
ids = torch.randint(1, 100, (2 if padded else 1, tokens))
given = {}
if padded:
    given["attention_mask"] = torch.ones_like(ids)
    given["attention_mask"][0, :8] = 0
for on in (False, True):
    model.swiftkv(on)
    with torch.no_grad(), PeakMemory("cpu", resident=list(model.parameters())) as meter:
        model(ids, use_cache=True, logits_to_keep=1, **given)
    prompt = f"{tokens} tokens" + (" x 2 padded" if padded else "")
    print(f"{prompt}, SwiftKV {'on' if on else 'off'}: peak {meter.peak_bytes / 2**20:.1f} MiB")
