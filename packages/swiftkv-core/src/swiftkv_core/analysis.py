"""Input similarity across layers (the paper's Eq. 1), and the choice of ``num_key_value_layers`` it suggests.

``similarity[i]`` is the mean, over every later layer ``j > i`` and every real token, of the cosine similarity
between the hidden state entering layer ``i`` and the one entering layer ``j``. A high value says the inputs
of the layers after ``i`` are all much alike, so their K/V can be computed from layer ``i``'s input.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from .atomic import atomic_file, atomic_write_text


@torch.inference_mode()
def layer_input_similarity(model, tokenizer, texts: Sequence[str], max_length: int = 512) -> list[float]:
    """Eq. 1 for every layer ``i < L - 1`` of a HF causal LM, averaged over ``texts`` (one at a time)."""
    if not texts:
        raise ValueError("layer_input_similarity needs at least one text.")
    if hasattr(model, "swiftkv_mode"):  # a SwiftKV model: the similarity of the ORIGINAL model's layer inputs
        with model.swiftkv_mode(False):
            return _similarity(model, tokenizer, texts, max_length)
    return _similarity(model, tokenizer, texts, max_length)


def _similarity(model, tokenizer, texts, max_length):
    num_layers = model.config.num_hidden_layers
    sums = torch.zeros(num_layers - 1, dtype=torch.float64)
    tokens = 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_length).input_ids
        ids = ids.to(model.device)
        # hidden_states[i] is the input of layer i (hidden_states[0] the embeddings); the last is after the norm.
        states = model(ids, output_hidden_states=True, use_cache=False).hidden_states[:num_layers]
        inputs = torch.stack([s[0].double() for s in states]).cpu()  # [L, T, H]
        unit = F.normalize(inputs, dim=-1)
        for i in range(num_layers - 1):
            cos = (unit[i][None] * unit[i + 1 :]).sum(-1)  # [L - i - 1, T]
            sums[i] += cos.mean(0).sum()
        tokens += ids.shape[1]
    return (sums / tokens).tolist()


def recommend_num_key_value_layers(similarity: Sequence[float], threshold: float) -> int:
    """The smallest ``l >= 1`` whose input similarity reaches ``threshold`` (``L`` if none does)."""
    for layer, value in enumerate(similarity):
        if layer >= 1 and value >= threshold:
            return layer
    return len(similarity) + 1


def write_similarity_report(
    similarity: Sequence[float],
    threshold: float,
    out_dir: str | Path,
    title: str = "",
    chosen: int | None = None,
) -> dict:
    """``similarity.json`` and ``similarity.png`` in ``out_dir``; returns the JSON content. ``chosen``: the ``l``
    actually used, marked on the plot beside the threshold rule's recommendation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_layers = len(similarity) + 1
    recommended = recommend_num_key_value_layers(similarity, threshold)
    result = {
        "similarity": list(similarity),
        "threshold": threshold,
        "recommended_num_key_value_layers": recommended,
        "skipped_fraction": (num_layers - recommended) / num_layers,
        "num_hidden_layers": num_layers,
    }
    atomic_write_text(out_dir / "similarity.json", json.dumps(result, indent=2))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(similarity)), similarity, marker="o", ms=3, label="input similarity (Eq. 1)")
    ax.axhline(threshold, color="gray", ls="--", label=f"threshold {threshold}")
    ax.axvline(recommended, color="C3", ls=":", label=f"threshold rule: l = {recommended}")
    if chosen is not None:
        ax.axvline(
            chosen,
            color="C2",
            ls="-",
            lw=2,
            label=f"chosen l = {chosen} ({(num_layers - chosen) / num_layers:.0%} skipped)",
        )
    ax.set_xlabel("layer i")
    ax.set_ylabel("mean cosine similarity with later layers' inputs")
    ax.set_title(title or "SwiftKV layer input similarity")
    ax.legend(loc="lower right")
    fig.tight_layout()
    with atomic_file(out_dir / "similarity.png", "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return result
