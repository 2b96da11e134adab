"""Early exit at layer ``l`` (SwiftKV paper, appendices D/E): an LM head on the hidden state entering layer ``l``.

Under SwiftKV the K/V of every layer ``>= l`` are computed from the hidden state entering layer ``l``. So a decode
step can stop there: when the early head is confident (top probability >= a threshold) its token is emitted, the
K/V of the later layers are still written from that same hidden state, and layers ``>= l`` are skipped for that
token. The head is trained by swiftkv-distill and saved beside the checkpoint as ``early_exit_head.safetensors``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

EARLY_EXIT_FILE = "early_exit_head.safetensors"


class EarlyExitHead(nn.Module):
    """``lm_head(norm(h))`` on the hidden state ``h`` entering layer ``l``; its own norm and projection."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float = 1e-6):
        super().__init__()
        self.norm = LlamaRMSNorm(hidden_size, eps=eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    @classmethod
    @torch.no_grad()
    def from_model(cls, model) -> EarlyExitHead:
        """Initialised from the model's final norm and LM head (copies: the head trains on its own)."""
        config = model.config
        head = cls(config.hidden_size, config.vocab_size, eps=config.rms_norm_eps)
        weight = model.lm_head.weight
        head.to(dtype=weight.dtype)
        head.norm.weight.copy_(model.model.norm.weight)
        head.lm_head.weight.copy_(weight)
        return head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden).to(self.lm_head.weight.dtype))  # a head of another dtype than h

    def save(self, out_dir: str | os.PathLike) -> Path:
        path = Path(out_dir) / EARLY_EXIT_FILE
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        meta = {
            "hidden_size": self.lm_head.in_features,
            "vocab_size": self.lm_head.out_features,
            "eps": self.norm.variance_epsilon,
        }
        save_file(tensors, path, metadata={"early_exit": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, checkpoint_dir: str | os.PathLike) -> EarlyExitHead | None:
        """The head saved in ``checkpoint_dir``, or ``None`` when the checkpoint has none."""
        path = Path(checkpoint_dir) / EARLY_EXIT_FILE
        if not path.is_file():
            return None
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            meta = json.loads(f.metadata()["early_exit"])
        head = cls(meta["hidden_size"], meta["vocab_size"], eps=meta["eps"])
        state = load_file(path)
        head.to(dtype=next(iter(state.values())).dtype)
        head.load_state_dict(state)
        return head


@torch.inference_mode()
def generate_with_early_exit(
    model,
    head: EarlyExitHead,
    input_ids: torch.Tensor,
    max_new_tokens: int = 32,
    threshold: float = 0.9,
    eos_token_id: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Greedy decoding (batch 1) that exits at layer ``l`` when ``head``'s top probability >= ``threshold``.

    Needs a SwiftKV model with ``swiftkv`` on (the exited tokens' later K/V come from the SwiftKV projections).
    ``head`` is moved to the model's device and cast to its dtype, in place. Returns ``(all ids, number of tokens
    emitted by the early head)``.
    """
    if not model.config.swiftkv:
        raise ValueError("generate_with_early_exit needs the SwiftKV forward: call model.swiftkv(True).")
    if input_ids.shape[0] != 1:
        raise ValueError("generate_with_early_exit decodes one sequence (batch size 1).")
    inner = model.model
    # load() gives it on the CPU, in the dtype it trained in (fp32 master weights): the model's device and dtype
    head.to(device=input_ids.device, dtype=model.dtype)
    out = model(input_ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    ids, exited = [input_ids, token], 0
    for _ in range(max_new_tokens - 1):
        if eos_token_id is not None and token.item() == eos_token_id:
            break
        hidden, context = inner.forward_prefix(input_ids=token, past_key_values=cache, use_cache=True)
        probs = torch.softmax(head(hidden[:, -1]).float(), dim=-1)
        confidence, early_token = probs.max(-1)
        if confidence.item() >= threshold:
            # Skip layers >= l, but write their K/V (they only depend on the hidden state entering layer l).
            for leader, (key, value) in inner.swiftkv_key_values(hidden, context.position_embeddings).items():
                cache.update(key, value, model.config.kv_cache_index(leader, swiftkv=True))
            token, exited = early_token[:, None], exited + 1
        else:
            final = inner.forward_suffix(hidden, context, swiftkv=True)
            token = model.lm_head(inner.norm(final[:, -1:])).argmax(-1)
        ids.append(token)
    return torch.cat(ids, dim=1), exited
