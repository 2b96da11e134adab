"""The library's own commands as typed functions: ``swiftkv convert | analyze | generate | flops`` run these (their
signatures and docstrings are the options and their help)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch


def convert(
    out_dir: Path,
    model: str = "default",
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    serving: bool = False,
    kv_init_text_files: list[Path] | None = None,
    kv_init_tokens: int = 32768,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Convert a Llama / Mistral / Qwen2 checkpoint to SwiftKV (not yet distilled).

    Args:
        out_dir: Folder for the SwiftKV checkpoint (written atomically).
        model: A local HF checkpoint folder, or 'default' for the embedded SmolLM2-135M-Instruct.
        num_key_value_layers: l: layers >= l take K/V from layer l's input (default: half the layers).
        key_value_group_size: AcrossKV group size g (1: off).
        serving: Leave out the teacher q/k/v of layers >= l (smaller; serving only).
        kv_init_text_files: Text files to fit k/v_proj_swiftkv on by least squares (swiftkv_core/kv_init.py), a far
            better start than the published init (default, without files).
        kv_init_tokens: Tokens of those files the fit reads at most.
        device: 'auto' (the GPU where one is visible), 'cpu', 'cuda' or 'cuda:N': where the K/V fit runs.
        dtype: The weights' dtype, also as written: 'auto' (bfloat16 on a GPU, float32 on a CPU), 'float32',
            'bfloat16' or 'float16'.
    """
    from .checkpoints import check_checkpoint, check_replaceable, read_config
    from .convert import convert as convert_model
    from .convert import save_checkpoint
    from .generation import load, load_tokenizer

    _, config = read_config(model)
    l = config.num_hidden_layers // 2 if num_key_value_layers is None else num_key_value_layers
    path, _ = check_checkpoint(model, l, key_value_group_size, kind="base")  # before any weight is read
    check_replaceable(out_dir, path, "--out_dir")
    _existing_files(kv_init_text_files, "--kv_init_text_files")
    _positive(kv_init_tokens=kv_init_tokens)
    device, dtype = _placement("convert", device, dtype)
    check_weights_fit(model, device, dtype)
    tokenizer = load_tokenizer(model, need=bool(kv_init_text_files))
    if kv_init_text_files:  # the fit's first batch before any weight is read: text too short is refused here
        from .kv_init import fit_kv_projections, text_batches

        texts = (Path(f).read_text() for f in kv_init_text_files)
        batches = iter(text_batches(tokenizer, texts, device=device))
        batches = itertools.chain([next(batches)], batches)
    base, _ = load(model, dtype=dtype, need_tokenizer=False, device=device)
    swift = convert_model(base, l, key_value_group_size)
    if kv_init_text_files:
        report = fit_kv_projections(swift, batches, max_tokens=kv_init_tokens)
        print(
            f"least-squares K/V init on {int(report['tokens'])} tokens: teacher K/V energy explained "
            f"{report['explained_mean']:.3f} on average, {report['explained_min']:.3f} at worst"
        )
    save_checkpoint(swift, out_dir, tokenizer=tokenizer, serving=serving)
    print(
        f"wrote {out_dir} ({type(swift).__name__}, num_key_value_layers={l}, "
        f"key_value_group_size={key_value_group_size}, serving_only={serving}, {str(dtype).removeprefix('torch.')})"
    )


def analyze(
    out_dir: Path = Path("outputs/analyze"),
    model: str = "default",
    texts: list[str] | None = None,
    text_files: list[Path] | None = None,
    threshold: float = 0.9,
    max_length: int = 512,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Per-layer input similarity (paper Eq. 1); recommends num_key_value_layers; writes JSON and a PNG.

    Args:
        out_dir: Folder for similarity.json and similarity.png.
        model: A local HF checkpoint folder, or 'default'.
        texts: Texts to analyse.
        text_files: Text files to analyse (one text per file). Without texts or files, a built-in sample.
        threshold: Recommend the smallest l whose similarity reaches this.
        max_length: Tokens per text at most.
        device: 'auto' (the GPU where one is visible), 'cpu', 'cuda' or 'cuda:N'.
        dtype: The weights' dtype: 'auto' (bfloat16 on a GPU, float32 on a CPU), 'float32', 'bfloat16' or 'float16'.
    """
    from .analysis import layer_input_similarity, write_similarity_report
    from .checkpoints import read_config
    from .default_model import resolve_model_path
    from .generation import load

    read_config(model)
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise NotADirectoryError(
            f"--out_dir {out_dir} is a file: give a folder for similarity.json and .png."
        )
    _existing_files(text_files, "--text_files")
    _positive(max_length=max_length)
    if not 0 < threshold <= 1:
        raise ValueError(f"--threshold {threshold}: a cosine similarity in (0, 1], e.g. 0.9 (the paper's).")
    texts = list(texts or []) + [Path(f).read_text() for f in text_files or []]
    if not texts:
        texts = _sample_texts()
    device, dtype = _placement("analyze", device, dtype)
    check_weights_fit(model, device, dtype)
    base, tokenizer = load(model, dtype=dtype, device=device)
    similarity = layer_input_similarity(base, tokenizer, texts, max_length=max_length)
    result = write_similarity_report(
        similarity, threshold, out_dir, title=f"{resolve_model_path(model).name}: layer input similarity"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "similarity"}, indent=2))
    print(f"wrote {out_dir}/similarity.json and similarity.png")


def generate(
    prompt: str = "What is the capital of France? Answer in one sentence.",
    model: str = "default",
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    max_new_tokens: int = 64,
    chat: bool = True,
    kv_cache_dtype: str = "auto",
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Greedy generation; prints the text, the prefill time and the KV cache's bytes.

    Args:
        prompt: The prompt (wrapped in the chat template when chat is on and the tokenizer has one).
        model: A SwiftKV or base checkpoint folder, or 'default'.
        num_key_value_layers: If set and the model is not SwiftKV yet, convert it on the fly with this l.
        key_value_group_size: AcrossKV group size for on-the-fly conversion.
        max_new_tokens: Tokens to generate.
        chat: Apply the tokenizer's chat template.
        kv_cache_dtype: 'auto' (the model's dtype) or 'fp8' (e4m3 with a float32 scale per token and KV head).
        device: 'auto' (the GPU where one is visible), 'cpu', 'cuda' or 'cuda:N'.
        dtype: The weights' dtype: 'auto' (bfloat16 on a GPU, float32 on a CPU), 'float32', 'bfloat16' or 'float16'.
    """
    from .chat import chat_prompt_batch
    from .checkpoints import check_checkpoint
    from .convert import convert as convert_model
    from .generation import load, time_prefill
    from .kv_cache import check_kv_cache_dtype, kv_cache_nbytes, make_kv_cache
    from .runtime import Stopwatch

    check_kv_cache_dtype(kv_cache_dtype)
    _positive(max_new_tokens=max_new_tokens)
    check_checkpoint(model, num_key_value_layers, key_value_group_size)  # family, and l / g when given
    device, dtype = _placement("generate", device, dtype)
    check_weights_fit(model, device, dtype)
    lm, tokenizer = load(model, dtype=dtype, device=device)
    if num_key_value_layers is not None and not hasattr(lm, "swiftkv"):
        lm = convert_model(lm, num_key_value_layers, key_value_group_size)
    if chat and tokenizer.chat_template:
        inputs = chat_prompt_batch(tokenizer, [prompt])
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    prefill_s = time_prefill(lm, inputs["input_ids"], repeats=1, kv_cache_dtype=kv_cache_dtype)
    cache = make_kv_cache(lm.config, kv_cache_dtype)
    watch = Stopwatch(lm.device).start()
    with torch.inference_mode():
        out = lm.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False)
    total_s = watch.stop()
    new = out[0, inputs["input_ids"].shape[1] :]
    mode = (
        (
            f"SwiftKV l={lm.config.num_key_value_layers}/{lm.config.num_hidden_layers} "
            f"g={lm.config.key_value_group_size}"
        )
        if getattr(lm.config, "swiftkv", False)
        else "original model"
    )
    print(tokenizer.decode(new, skip_special_tokens=True))
    print(
        f"[{mode}] prompt {inputs['input_ids'].shape[1]} tokens: prefill {prefill_s * 1000:.1f} ms; "
        f"{len(new)} new tokens in {total_s:.2f} s; KV cache ({kv_cache_dtype}) "
        f"{kv_cache_nbytes(cache) / 1024:.1f} KiB"
    )


def flops(
    model: str | None = None,
    num_key_value_layers: int | None = None,
    key_value_group_size: int | None = None,
    seq_len: int = 8192,
    attention: str = "causal",
    kv_cache_dtype: str = "bf16",
) -> None:
    """Analytic prefill FLOPs and KV-cache size per token; without --model, our model against paper Table 1.

    Args:
        model: A checkpoint folder (only config.json is read) or 'default'; omit for the paper's Table 1.
        num_key_value_layers: l to account for (default: the checkpoint's own, or half the layers).
        key_value_group_size: AcrossKV group size g (default: the checkpoint's own, or 1).
        seq_len: Prompt length the attention row is averaged over.
        attention: 'causal' (keys a causal query sees) or 'dense' (all keys, as dense kernels compute).
        kv_cache_dtype: KV cache storage to account: 'bf16', 'fp16', 'fp32' or 'fp8' (e4m3 + float32 scales).
    """
    from transformers import AutoConfig

    from .configuration import validate_layers
    from .default_model import resolve_model_path
    from .flops import ROWS, ModelShape, format_table1, kv_cache_bytes_per_token, prefill_flops
    from .kv_cache import storage_bytes

    storage_bytes(kv_cache_dtype)  # an unknown name fails here, before any work
    _positive(seq_len=seq_len)
    if attention not in ("causal", "dense"):
        raise ValueError(f"--attention {attention!r}: 'causal' or 'dense'.")
    if model is None:
        print(format_table1())
        return
    config = AutoConfig.from_pretrained(resolve_model_path(model))
    shape = ModelShape.from_config(config)
    L = shape.num_hidden_layers
    if num_key_value_layers is None:  # the checkpoint's own, else half the layers
        num_key_value_layers = getattr(config, "num_key_value_layers", None) or L // 2
    if key_value_group_size is None:
        key_value_group_size = getattr(config, "key_value_group_size", None) or 1
    l, g = num_key_value_layers, key_value_group_size
    validate_layers(L, l, g)  # 0 or out of range: refused, not replaced by a default
    base, swift = (
        prefill_flops(shape, seq_len, attention=attention),
        prefill_flops(shape, seq_len, l, g, attention),
    )
    print(f"GFLOPs per prefill token ({seq_len} tokens, attention={attention}); SwiftKV l={l}/{L}, g={g}")
    print(f"{'row':<12}{'original':>12}{'SwiftKV':>12}")
    for row in (*ROWS, "total"):
        print(f"{row:<12}{getattr(base, row) / 1e9:>12.4f}{getattr(swift, row) / 1e9:>12.4f}")
    print(f"relative prefill compute: {swift.total / base.total:.1%}")
    kv_bf16 = kv_cache_bytes_per_token(shape)
    kv_base = kv_cache_bytes_per_token(shape, kv_cache_dtype=kv_cache_dtype)
    kv_swift = kv_cache_bytes_per_token(shape, l, g, kv_cache_dtype)
    print(
        f"KV cache per token ({kv_cache_dtype}): {kv_base / 1024:.1f} KiB -> {kv_swift / 1024:.1f} KiB "
        f"({kv_base / kv_swift:.2f}x more tokens in the same memory; "
        f"{1 - kv_swift / kv_bf16:.1%} less than the original model in bf16)"
    )


def _placement(command: str, device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """``--device`` and ``--dtype`` checked and resolved before any weight is read, and said."""
    from .runtime import choose_device, choose_dtype, device_description

    chosen = choose_device(device)
    chosen_dtype = choose_dtype(dtype, chosen)
    print(
        f"swiftkv {command}: on {device_description(chosen)}, {str(chosen_dtype).removeprefix('torch.')} "
        f"(--device {device} -> {chosen})",
        flush=True,
    )
    return chosen, chosen_dtype


def check_weights_fit(model: str, device: torch.device, dtype: torch.dtype, have: int | None = None) -> None:
    """Refuse, before any weight is read, a model whose weights alone outgrow ``device``'s memory (``have`` bytes,
    default ``runtime.device_memory_bytes``): a 70B model in bf16 onto one 80 GB GPU would fail mid-load with
    CUDA's out-of-memory error, or a CPU's with the kernel's kill. The message names what fits instead."""
    from .checkpoints import stored_parameter_count
    from .runtime import device_description, device_memory_bytes

    count = stored_parameter_count(model)
    have = device_memory_bytes(device) if have is None else have
    need = count * dtype.itemsize if count else 0
    if not have or need <= have:
        return
    host = device_memory_bytes("cpu") or 0
    fixes = []
    if device.type != "cpu" and count * 2 <= host:
        fixes.append(f"--device cpu --dtype bfloat16 ({count * 2 / 2**30:.1f} GiB of this machine's memory)")
    if dtype.itemsize > 2 and count * 2 <= have:
        fixes.append(f"--dtype bfloat16 ({count * 2 / 2**30:.1f} GiB)")
    fixes.append("a device with more memory")
    raise ValueError(
        f"{model}: its {count / 1e9:.1f}B weights take {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}"
        f" and {device_description(device)} has {have / 2**30:.1f} GiB: use {', or '.join(fixes)}."
    )


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name} {value}: must be a positive integer.")


def _existing_files(files: list[Path] | None, option: str) -> None:
    missing = [str(f) for f in files or [] if not Path(f).is_file()]
    if missing:
        raise ValueError(f"{option}: {missing} not found: give existing text files.")


def _sample_texts() -> list[str]:
    import inspect
    import json as json_module

    return [inspect.getdoc(json_module), inspect.getdoc(inspect), inspect.getdoc(Path)]
