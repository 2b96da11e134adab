"""Real checkpoints on disk for the serve tests: a tiny random Llama SwiftKV and SmolLM2 converted to SwiftKV."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)


def smollm2_path() -> Path:
    from swiftkv_core.default_model import default_model_path

    return default_model_path()


def tiny_base(out_dir: Path, seed: int = 0, family: str = "llama") -> Path:
    """A tiny random Llama or Qwen2 (head_dim 32, the CPU kernels' smallest) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY,
    )
    model = model_cls(config).eval()
    if family == "qwen2":  # random biases too, so that the q/k/v biases are exercised
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def swiftkv_checkpoint(
    base: Path,
    out_dir: Path,
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    noise: float = 0.0,
    serving: bool = False,
    seed: int = 0,
    lora_rank: int = 0,
) -> Path:
    """``base`` converted to SwiftKV (published recipe init), optionally with the SwiftKV weights perturbed.

    The noise makes the SwiftKV projections differ from the teacher's, so a server that used the wrong
    weights (or the teacher path) would not match. ``lora_rank``: with adapters on o_proj and the MLP of layers
    ``>= l`` (the noise gives them a non-zero update), merged into the weights by a serving export.
    """
    from transformers import AutoTokenizer

    from swiftkv_core.convert import convert, export_for_serving, save_checkpoint

    model = convert(base, num_key_value_layers, key_value_group_size)
    if lora_rank:
        torch.manual_seed(seed)  # the adapters' A: the same in the full checkpoint and its serving export
        model.add_lora(lora_rank)
    if noise:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("lora_b"):  # zero at the start: a scale of its own
                    param.add_(noise * 0.1 * torch.randn(param.shape, generator=generator))
                elif "swiftkv" in name:
                    param.add_(noise * param.abs().mean() * torch.randn(param.shape, generator=generator))
    tokenizer = AutoTokenizer.from_pretrained(base)
    (export_for_serving if serving else save_checkpoint)(model, out_dir, tokenizer=tokenizer)
    return out_dir


@torch.inference_mode()
def hf_greedy(
    path: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu", dtype=torch.float32
) -> list[list[int]]:
    """The reference: swiftkv_core's HF model (SwiftKV forward as configured), ``generate`` greedy, one prompt each."""
    from swiftkv_core.generation import load

    model, _ = load(path, dtype=dtype)
    model = model.to(device)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
