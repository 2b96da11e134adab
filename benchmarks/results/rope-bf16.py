"""How far RoPE frequencies rounded to bf16 move a model's predictions: what `model.to(torch.bfloat16)` (Lightning's
`bf16-true`) did to the teacher and the student before 343f5a0 kept them in fp32.

The default model (SmolLM2-135M-Instruct, rope_theta 100000) loaded in bf16 on the CPU: as loaded (fp32 frequencies,
as HF and vLLM compute them) against the same weights with the rotary buffers rounded to bf16, on real text (the
standard library's documentation: 5,396 tokens before it repeats). Per range of positions: top-1 agreement and
KL(as loaded || rounded), nats per token.

    .venv/bin/python benchmarks/results/rope-bf16.py [TOKENS]      # default 4096
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from swiftkv_core.default_model import default_model_path
from swiftkv_core.generation import sample_prompt_ids


@torch.inference_mode()
def main(tokens: int = 4096) -> None:
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = sample_prompt_ids(tokenizer, tokens)
    rotary = model.model.rotary_emb
    exact = {name: buffer.clone() for name, buffer in rotary.named_buffers()}
    assert {b.dtype for b in exact.values()} == {torch.float32}
    logits = {}
    for label, dtype in (("fp32 frequencies", torch.float32), ("bf16 frequencies", torch.bfloat16)):
        for name, buffer in exact.items():
            rotary._buffers[name] = buffer.to(dtype)
        logits[label] = model(ids, use_cache=False).logits[0].float()
    a, b = logits.values()
    error = (exact["inv_freq"].bfloat16().float() - exact["inv_freq"]).abs() / exact["inv_freq"]
    print(f"{path.name}, bf16 weights, {ids.shape[1]} tokens; inv_freq rounded to bf16: relative error up to "
          f"{error.max():.2%}, phase error at the last position up to "
          f"{((exact['inv_freq'].bfloat16().float() - exact['inv_freq']).abs() * (ids.shape[1] - 1)).max():.2f} rad")  # fmt: skip
    log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
    kl = (log_a.exp() * (log_a - log_b)).sum(-1)
    agree = a.argmax(-1) == b.argmax(-1)
    print("| positions | top-1 agreement | KL (nats/token) |\n|---|---|---|")
    edges = [0, 256, 512, 1024, 2048, 4096, 8192]
    for lo, hi in zip(edges, edges[1:], strict=False):
        if lo >= ids.shape[1]:
            break
        rows = slice(lo, min(hi, ids.shape[1]))
        print(
            f"| {lo}-{min(hi, ids.shape[1]) - 1} | {agree[rows].float().mean():.1%} | {kl[rows].mean():.4f} |"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
