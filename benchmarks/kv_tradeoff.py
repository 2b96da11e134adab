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
``--checkpoints`` (``{"l=15,g=3": "runs/.../distilled"}``), else the base converted with the least-squares K/V
fit (swiftkv_core.kv_init), a start that distillation improves on: the weights column says which.

- vLLM's KV capacity: the tokens a real vLLM engine (this plugin, eager, bf16 weights) fits in ``--vllm_kv_gib``
  of KV cache, per row and cache dtype (``auto`` = bf16, ``fp8``); a dtype the machine's vLLM refuses (fp8 on a
  CPU without AVX-512/AMX) is reported with vLLM's reason.

    .venv/bin/python benchmarks/kv_tradeoff.py --texts 4 \\
        --checkpoints '{"l=15,g=1": "runs/smollm2-135m-instruct-l15/distilled", "l=15,g=3": ...}'
    .venv/bin/python benchmarks/kv_tradeoff.py --texts 1 --text_tokens 24 --rows '["l=15,g=3"]' --vllm false --tag smoke

Rows (``--rows``): by default g=1 at l = L/2 and AcrossKV g = 2, 3, 5, each at the smallest l >= L/2 where g divides
L - l (the published format's rule): SmolLM2 has 30 layers, so g=2 runs at l=16 (23 KV layers, as a ragged g=2 at
l=15 would have). Writes ``benchmarks/results/kv-tradeoff[-TAG].{json,md,png}``.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
KV_CACHE_DTYPES = {"auto": "bf16", "fp8": "fp8"}  # cache option -> storage accounted
DEFAULT_GROUP_SIZES = (1, 2, 3, 5)


def parse_row(name: str) -> tuple[int, int]:
    """``"l=15,g=3"`` -> ``(15, 3)``."""
    try:
        values = dict(item.split("=") for item in name.replace(" ", "").split(","))
        return int(values["l"]), int(values.get("g", 1))
    except (ValueError, KeyError):
        raise SystemExit(
            f"row {name!r}: write it as 'l=15,g=3' (l: num_key_value_layers, g: group size)."
        ) from None


def default_rows(num_hidden_layers: int) -> list[str]:
    """g = 1, 2, 3, 5, each at the smallest l >= L/2 where g divides L - l (at most one layer more per step)."""
    rows = []
    for g in DEFAULT_GROUP_SIZES:
        l = next(
            l for l in range(num_hidden_layers // 2, num_hidden_layers) if (num_hidden_layers - l) % g == 0
        )
        rows.append(f"l={l},g={g}")
    return rows


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


def row_model(
    base, base_path, tokenizer, l: int | None, g: int, checkpoints: dict, kv_init_tokens: int, scratch
):
    """The model of a row, where its weights come from, and a folder vLLM can load it from."""
    from swiftkv_core.convert import convert, export_for_serving
    from swiftkv_core.generation import load
    from swiftkv_core.kv_init import fit_kv_projections, text_batches

    if l is None:
        return base, "base model", str(base_path)
    name = f"l={l},g={g}"
    if name in checkpoints:
        model, _ = load(checkpoints[name], need_tokenizer=False)
        if (model.config.num_key_value_layers, model.config.key_value_group_size) != (l, g):
            raise SystemExit(
                f"--checkpoints[{name!r}] is a l={model.config.num_key_value_layers}, "
                f"g={model.config.key_value_group_size} checkpoint."
            )
        return model.swiftkv(True), f"checkpoint {checkpoints[name]}", checkpoints[name]
    from swiftkv_distill.corpora import prepare

    model = convert(base, l, g)
    texts = (json.loads(line)["text"] for line in prepare("brown_train").open())
    fit_kv_projections(model, text_batches(tokenizer, texts), max_tokens=kv_init_tokens)
    path = export_for_serving(model, Path(scratch) / name, tokenizer)
    return (
        model,
        f"converted, least-squares K/V on {kv_init_tokens} brown_train tokens (not distilled)",
        str(path),
    )


def main(
    model: str = "default",
    rows: list[str] | None = None,
    checkpoints: dict[str, str] | None = None,
    texts: int = 8,
    text_tokens: int = 256,
    kv_init_tokens: int = 32768,
    vllm: bool = True,
    vllm_kv_gib: float = 1.0,
    tag: str = "",
    report_only: bool = False,
) -> dict:
    """Per row and cache dtype: KV bytes per token, reduction, held-out KL and top-1 agreement to the teacher,
    and vLLM's KV capacity in tokens.

    Args:
        model: Base checkpoint folder or 'default' (SmolLM2-135M-Instruct).
        rows: SwiftKV rows besides the baseline, e.g. '["l=15,g=1", "l=16,g=2"]' (default: g = 1, 2, 3, 5 at
            l >= L/2, see the module docstring).
        checkpoints: Distilled checkpoint per row, keyed like ``rows``; other rows are converted on the fly.
        texts: Held-out texts decoded.
        text_tokens: Tokens per text (each position's next-token distribution is compared).
        kv_init_tokens: Tokens of the least-squares K/V fit of converted rows.
        vllm: Measure vLLM's KV capacity per row (needs swiftkv-serve; one engine start per row and dtype).
        vllm_kv_gib: The KV-cache space of each of those engines.
        tag: Suffix of the result files.
        report_only: Rewrite the .md and .png from the .json of ``tag`` (no measurement).
    """
    if report_only:
        result = json.loads((RESULTS / f"{_name(tag)}.json").read_text())
        write(result, tag)
        return result
    from swiftkv_core.configuration import validate_layers
    from swiftkv_core.default_model import resolve_model_path
    from swiftkv_core.flops import ModelShape, kv_cache_bytes_per_token
    from swiftkv_core.generation import load
    from swiftkv_core.kv_cache import storage_name

    command = shlex.join([".venv/bin/python", "benchmarks/kv_tradeoff.py", *sys.argv[1:]])
    base_path = resolve_model_path(model)
    base, tokenizer = load(base_path)
    L = base.config.num_hidden_layers
    rows = rows or default_rows(L)
    checkpoints = checkpoints or {}
    settings = [(None, 1)] + [parse_row(name) for name in rows]
    for l, g in settings[1:]:  # every row, checkpoint and option is checked before any compute
        validate_layers(L, l, g, allow_no_skip=False)
    unknown = set(checkpoints) - {f"l={l},g={g}" for l, g in settings[1:]}
    missing = [path for path in checkpoints.values() if not Path(path).is_dir()]
    if unknown or missing:
        raise SystemExit(f"--checkpoints: {sorted(unknown)} are not rows {rows}; {missing} are not folders.")
    if vllm and not _importable("swiftkv_serve"):
        raise SystemExit("--vllm true needs swiftkv-serve (pip install swiftkv-serve[cpu]); or --vllm false.")

    torch.manual_seed(0)
    shape = ModelShape.from_config(base.config)
    ids = held_out_texts(tokenizer, texts, text_tokens)
    teacher = [decode_through_cache(base, x, "auto")[0] for x in ids]
    baseline_bytes = kv_cache_bytes_per_token(shape, kv_cache_dtype="bf16")
    results = []
    with tempfile.TemporaryDirectory(prefix="kv-tradeoff-") as scratch:
        for l, g in settings:
            row_lm, source, path = row_model(
                base, base_path, tokenizer, l, g, checkpoints, kv_init_tokens, scratch
            )
            for kv_cache_dtype, storage in KV_CACHE_DTYPES.items():
                start = time.perf_counter()
                kl, agree, positions = 0.0, 0.0, 0
                for x, reference in zip(ids, teacher, strict=True):
                    logprobs, held = decode_through_cache(row_lm, x, kv_cache_dtype)
                    kl += F.kl_div(logprobs, reference, log_target=True, reduction="sum").item()
                    agree += (logprobs.argmax(-1) == reference.argmax(-1)).sum().item()
                    positions += x.shape[1]
                    held_storage = storage_name(next(row_lm.parameters()).dtype, kv_cache_dtype)
                    if held != kv_cache_bytes_per_token(shape, l, g, held_storage) * x.shape[1]:
                        raise AssertionError(
                            f"cache holds {held} bytes, not what flops.py accounts ({held_storage})"
                        )
                per_token = kv_cache_bytes_per_token(shape, l, g, storage)
                name = (
                    "baseline"
                    if l is None
                    else f"SingleInputKV l={l}/{L}" + (f" + AcrossKV g={g}" if g > 1 else "")
                )
                results.append(
                    {
                        "row": name,
                        "num_key_value_layers": l,
                        "key_value_group_size": g,
                        "kv_cache": storage,
                        "kv_bytes_per_token": per_token,
                        "kv_reduction": 1 - per_token / baseline_bytes,
                        "kl": kl / positions,
                        "top1_agreement": agree / positions,
                        "weights": source,
                        **(vllm_capacity(path, kv_cache_dtype, vllm_kv_gib) if vllm else {}),
                        "seconds": round(time.perf_counter() - start, 1),
                    }
                )
                print(json.dumps(results[-1]), flush=True)
    result = {
        "model": model,
        "texts": texts,
        "text_tokens": text_tokens,
        "vllm_kv_gib": vllm_kv_gib if vllm else None,
        "command": command,
        "rows": results,
    }
    write(result, tag)
    return result


def vllm_capacity(path: str, kv_cache_dtype: str, kv_gib: float) -> dict:
    """Tokens vLLM's KV cache holds in ``kv_gib`` for the checkpoint at ``path`` (its own engine, in a child
    process), or the reason it refused the cache dtype."""
    from swiftkv_serve.bench import run_in_child
    from swiftkv_serve.child import ChildProcessFailed

    try:
        run = run_in_child(
            Path(path), f"vLLM {kv_cache_dtype} cache", {}, num_requests=1, max_num_seqs=1, compile=False,
            kv_cache_gib=kv_gib, max_model_len=512, dtype="bfloat16",
            engine_options={"kv_cache_dtype": kv_cache_dtype}, timeout_s=600,
        )  # fmt: skip
    except ChildProcessFailed as error:
        return {"vllm_kv_tokens": None, "vllm_refused": str(error).strip().splitlines()[-1][:300]}
    return {"vllm_kv_tokens": run["kv_cache_tokens"]}


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _name(tag: str) -> str:
    return "kv-tradeoff" + (f"-{tag}" if tag else "")


def write(result: dict, tag: str) -> None:
    from swiftkv_core.atomic import atomic_file

    name = _name(tag)
    RESULTS.mkdir(exist_ok=True)
    with atomic_file(RESULTS / f"{name}.json") as f:
        f.write(json.dumps(result, indent=2) + "\n")
    base_tokens = next((r.get("vllm_kv_tokens") for r in result["rows"] if r["row"] == "baseline"), None)
    capacity = (
        f"vLLM KV capacity in {result['vllm_kv_gib']} GiB (tokens)" if result.get("vllm_kv_gib") else None
    )
    lines = [
        f"# KV memory vs accuracy: {result['model']}, {result['texts']} held-out Brown texts x "
        f"{result['text_tokens']} tokens, decoded token by token through each cache; teacher: the original "
        "model with an fp32 cache",
        "",
        "| row | KV cache | bytes/token | reduction vs bf16 baseline | KL (nats/token) | top-1 agreement | "
        + (f"{capacity} |" if capacity else "")
        + " weights |",
        "|---|---|---:|---:|---:|---:|" + ("---:|" if capacity else "") + "---|",
    ]
    for r in result["rows"]:
        cells = [
            r["row"], r["kv_cache"], f"{r['kv_bytes_per_token']:.0f}", f"{r['kv_reduction']:.1%}",
            f"{r['kl']:.4f}", f"{r['top1_agreement']:.1%}",
        ]  # fmt: skip
        if capacity:
            tokens = r.get("vllm_kv_tokens")
            cells.append(
                f"{tokens:,} ({tokens / base_tokens:.2f}x)"
                if tokens and base_tokens
                else f"refused: {r.get('vllm_refused', '?')}"
            )
        lines.append("| " + " | ".join(cells + [r["weights"]]) + " |")
    lines += [
        "",
        f"![agreement and KL vs KV bytes per token]({name}.png)",
        "",
        f"Command: `{result.get('command', '.venv/bin/python benchmarks/kv_tradeoff.py')}`",
        "",
        "Distilled rows (weights `runs/<model>-l<l>[-g<g>]/distilled`): the output of `swiftkv quickstart "
        "--num_key_value_layers l --key_value_group_size g --serve false` (the CPU recipe: least-squares K/V init "
        "per group, then 12 min of distillation on prose + the teacher's chat answers); each quickstart's "
        "`report.md` there has its held-out chat figures too.",
        "",
        "The paper (arXiv 2410.03960, Table 7, Llama-3.1-8B, 50% SingleInputKV): AcrossKV alone -25% KV memory at "
        "under one point of accuracy; with an FP8 KV cache -62.5% (no scales counted; ours count a float32 scale per "
        "token and KV head, and vLLM's capacity column counts what vLLM stores: one scale per layer).",
    ]
    with atomic_file(RESULTS / f"{name}.md") as f:
        f.write("\n".join(lines) + "\n")
    plot(result["rows"], RESULTS / f"{name}.png")


def plot(rows: list[dict], png: Path) -> None:
    """Top-1 agreement and KL against KV bytes per token: one point per row and cache dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from swiftkv_core.atomic import atomic_file

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    names = list(dict.fromkeys(r["row"] for r in rows))
    for ax, key, title in ((axes[0], "top1_agreement", "top-1 agreement with the teacher"),
                           (axes[1], "kl", "KL(teacher || row), nats/token")):  # fmt: skip
        for index, name in enumerate(names):
            points = sorted((r for r in rows if r["row"] == name), key=lambda r: r["kv_bytes_per_token"])
            ax.plot([r["kv_bytes_per_token"] for r in points], [r[key] for r in points], color=f"C{index}",
                    alpha=0.4, lw=1)  # fmt: skip
            for r in points:
                ax.scatter(r["kv_bytes_per_token"], r[key], color=f"C{index}", s=60,
                           marker="^" if r["kv_cache"] == "fp8" else "o",
                           label=f"{name} ({r['kv_cache']})")  # fmt: skip
        ax.set_xlabel("KV-cache bytes per token (lower: more tokens fit)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(
        "KV memory vs quality, cache in the loop (o: bf16 cache, ^: FP8 cache; lines join a row's two caches)"
    )
    fig.tight_layout()
    with atomic_file(png, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
