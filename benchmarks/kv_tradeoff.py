"""KV memory against accuracy (the paper's Sec. 5.3 trade-off): SingleInputKV, AcrossKV and the FP8 KV cache.

For each row (the original model; SwiftKV at ``l``; + AcrossKV ``g`` for each group size), with the cache in
bf16 and in FP8 (swiftkv_core.kv_cache: e4m3 + a float32 scale per token and KV head):

- KV bytes per token (``flops.kv_cache_bytes_per_token``, what the cache holds: checked against the bytes the
  cache really holds after the run) and the reduction against the original model in bf16;
- held-out KL(teacher || row) and top-1 agreement with the teacher (the original model, fp32 cache), with the
  cache IN THE LOOP: each held-out text is decoded token by token through the row's cache, so every position
  reads K/V as the cache stored them (for FP8: dequantised), as serving would.

The plain rows run in fp32 on CPU (their cache stores fp32); their bytes are accounted in bf16, the serving
dtype, whose rounding (2^-9) is far below e4m3's (2^-4). A row uses the distilled checkpoint given for it in
``--checkpoints`` (``{"l=15,g=3": "runs/.../checkpoint"}``), else the base converted with the least-squares K/V
fit (swiftkv_core.kv_init), a start that distillation improves on: say which in any report.

    flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/kv_tradeoff.py          # SmolLM2, l=15, g=1/3/5
    .venv/bin/python benchmarks/kv_tradeoff.py --texts 1 --text_tokens 24 --group_sizes '[3]' --tag smoke

SmolLM2 has 30 layers: at l=15 the 15 later layers split into groups of 3, 5 or 15 only (g=2 needs l=14 or 16).
Writes ``benchmarks/results/kv-tradeoff[-TAG].{json,md}``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
KV_CACHE_DTYPES = {"auto": "bf16", "fp8": "fp8"}  # cache option -> storage accounted


def held_out_texts(tokenizer, texts: int, text_tokens: int) -> list[torch.Tensor]:
    """``texts`` rows of ``text_tokens`` ids each, cut from the held-out Brown paragraphs (never trained on)."""
    from swiftkv_distill.corpora import prepare

    ids: list[int] = []
    for line in prepare("brown_heldout").open():
        ids += tokenizer(json.loads(line)["text"] + "\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= texts * text_tokens:
            break
    return [torch.tensor(ids[i * text_tokens : (i + 1) * text_tokens])[None] for i in range(texts)]


@torch.inference_mode()
def decode_through_cache(model, ids: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, int]:
    """Next-token log-probabilities of every position, one token per forward through a fresh cache;
    and the bytes that cache holds at the end."""
    from swiftkv_core.kv_cache import kv_cache_nbytes, make_kv_cache

    cache = make_kv_cache(model.config, kv_cache_dtype)
    logits = [
        model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
        for t in range(ids.shape[1])
    ]
    return torch.stack(logits).log_softmax(-1), kv_cache_nbytes(cache)


def row_model(base, tokenizer, l: int | None, g: int, checkpoints: dict[str, str], kv_init_tokens: int):
    """The model of a row and where its weights come from."""
    from swiftkv_core.convert import convert
    from swiftkv_core.generation import load
    from swiftkv_core.kv_init import fit_kv_projections, text_batches

    if l is None:
        return base, "base model"
    name = f"l={l},g={g}"
    if name in checkpoints:
        model, _ = load(checkpoints[name], need_tokenizer=False)
        if (model.config.num_key_value_layers, model.config.key_value_group_size) != (l, g):
            raise SystemExit(
                f"--checkpoints[{name!r}] is a l={model.config.num_key_value_layers}, "
                f"g={model.config.key_value_group_size} checkpoint."
            )
        return model.swiftkv(True), f"checkpoint {checkpoints[name]}"
    from swiftkv_distill.corpora import prepare

    model = convert(base, l, g)
    texts = (json.loads(line)["text"] for line in prepare("brown_train").open())
    fit_kv_projections(model, text_batches(tokenizer, texts), max_tokens=kv_init_tokens)
    return model, f"converted, least-squares K/V on {kv_init_tokens} brown_train tokens (not distilled)"


def main(
    model: str = "default",
    num_key_value_layers: int | None = None,
    group_sizes: list[int] | None = None,
    checkpoints: dict[str, str] | None = None,
    texts: int = 8,
    text_tokens: int = 256,
    kv_init_tokens: int = 32768,
    tag: str = "",
    report_only: bool = False,
) -> dict:
    """Per row and cache dtype: KV bytes per token, reduction, held-out KL and top-1 agreement to the teacher.

    Args:
        model: Base checkpoint folder or 'default' (SmolLM2-135M-Instruct).
        num_key_value_layers: l of the SwiftKV rows (default: half the layers).
        group_sizes: AcrossKV group sizes of the rows besides g=1 (default: 3 and 5; each must divide L - l).
        checkpoints: Distilled checkpoint per row, keyed 'l=15,g=3'; other rows are converted on the fly.
        texts: Held-out texts decoded.
        text_tokens: Tokens per text (each position's next-token distribution is compared).
        kv_init_tokens: Tokens of the least-squares K/V fit of converted rows.
        tag: Suffix of the result files.
        report_only: Rewrite the .md and .png from the .json of ``tag`` (no measurement).
    """
    if report_only:
        result = json.loads((RESULTS / f"{_name(tag)}.json").read_text())
        write(result, tag)
        return result
    from swiftkv_core.configuration import validate_layers
    from swiftkv_core.flops import ModelShape, kv_cache_bytes_per_token
    from swiftkv_core.generation import load
    from swiftkv_core.kv_cache import storage_name

    torch.manual_seed(0)
    base, tokenizer = load(model)
    L = base.config.num_hidden_layers
    l = L // 2 if num_key_value_layers is None else num_key_value_layers
    settings = [(None, 1), (l, 1)] + [(l, g) for g in (group_sizes or [3, 5])]
    for _, g in settings[1:]:  # every row's (l, g) is checked before any compute
        validate_layers(L, l, g, allow_no_skip=False)
    shape = ModelShape.from_config(base.config)
    ids = held_out_texts(tokenizer, texts, text_tokens)
    teacher = [decode_through_cache(base, x, "auto")[0] for x in ids]
    baseline_bytes = kv_cache_bytes_per_token(shape, kv_cache_dtype="bf16")
    rows = []
    for l_row, g in settings:
        row_lm, source = row_model(base, tokenizer, l_row, g, checkpoints or {}, kv_init_tokens)
        for kv_cache_dtype, storage in KV_CACHE_DTYPES.items():
            start = time.perf_counter()
            kl, agree, positions = 0.0, 0.0, 0
            for x, reference in zip(ids, teacher, strict=True):
                logprobs, held = decode_through_cache(row_lm, x, kv_cache_dtype)
                kl += F.kl_div(logprobs, reference, log_target=True, reduction="sum").item()
                agree += (logprobs.argmax(-1) == reference.argmax(-1)).sum().item()
                positions += x.shape[1]
                held_storage = storage_name(next(row_lm.parameters()).dtype, kv_cache_dtype)
                if held != kv_cache_bytes_per_token(shape, l_row, g, held_storage) * x.shape[1]:
                    raise AssertionError(
                        f"cache holds {held} bytes, not what flops.py accounts ({held_storage})"
                    )
            per_token = kv_cache_bytes_per_token(shape, l_row, g, storage)
            rows.append(
                {
                    "row": "baseline"
                    if l_row is None
                    else f"SingleInputKV l={l_row}/{L}" + (f" + AcrossKV g={g}" if g > 1 else ""),
                    "kv_cache": storage,
                    "kv_bytes_per_token": per_token,
                    "kv_reduction": 1 - per_token / baseline_bytes,
                    "kl": kl / positions,
                    "top1_agreement": agree / positions,
                    "weights": source,
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    result = {"model": model, "texts": texts, "text_tokens": text_tokens, "rows": rows}
    write(result, tag)
    return result


def _name(tag: str) -> str:
    return "kv-tradeoff" + (f"-{tag}" if tag else "")


def write(result: dict, tag: str) -> None:
    name = _name(tag)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# KV memory vs accuracy: {result['model']}, {result['texts']} held-out Brown texts x "
        f"{result['text_tokens']} tokens, decoded token by token through each cache; teacher: the original "
        "model with an fp32 cache",
        "",
        "| row | KV cache | bytes/token | reduction vs bf16 baseline | KL (nats/token) | top-1 agreement | weights |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['row']} | {r['kv_cache']} | {r['kv_bytes_per_token']:.0f} | {r['kv_reduction']:.1%} | "
            f"{r['kl']:.4f} | {r['top1_agreement']:.1%} | {r['weights']} |"
        )
    lines += [
        "",
        f"![agreement and KL vs KV bytes per token]({name}.png)",
        "",
        f"Command: `flock /tmp/swiftkv-heavy.lock .venv/bin/python benchmarks/kv_tradeoff.py --texts {result['texts']} "
        "--checkpoints '{\"l=15,g=1\": DISTILLED}'` (the weights column names each row's checkpoint).",
        "",
        "The paper (arXiv 2410.03960, Table 7, Llama-3.1-8B): AcrossKV alone -25% KV memory at under one point of "
        "accuracy; with an FP8 KV cache -62.5% (no scales counted; ours count a float32 scale per token and KV head).",
    ]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    plot(result["rows"], RESULTS / f"{name}.png")


def plot(rows: list[dict], png: Path) -> None:
    """Top-1 agreement and KL against KV bytes per token: one point per row and cache dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(dict.fromkeys(r["row"] for r in rows))
    for ax, key, title in ((axes[0], "top1_agreement", "top-1 agreement with the teacher"),
                           (axes[1], "kl", "KL(teacher || row), nats/token")):  # fmt: skip
        for index, name in enumerate(names):
            for r in (r for r in rows if r["row"] == name):
                ax.scatter(r["kv_bytes_per_token"], r[key], color=f"C{index}", s=60,
                           marker="^" if r["kv_cache"] == "fp8" else "o",
                           label=f"{name} ({r['kv_cache']})")  # fmt: skip
        ax.set_xlabel("KV-cache bytes per token")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("KV memory vs quality (o: bf16 cache, ^: FP8 cache)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
