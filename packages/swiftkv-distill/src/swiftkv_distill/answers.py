"""A teacher's own answers to chat prompts: chat-shaped distillation data that follows the teacher's distribution.

``teacher_answers(prompts, model)`` poses each prompt as one user turn (``swiftkv_core.chat``) to the ORIGINAL
model and samples an answer (seeded: the same answers on every run). The generation is a backend: ``"hf"``
(transformers ``generate`` in batches, built in) or one that another package provides through the entry-point
group ``swiftkv_core.answer_backends`` (swiftkv-serve provides ``"vllm"``: batched, several times faster);
``"auto"`` takes vLLM where its backend and vLLM are installed. Answers are cached under a key of the teacher's
identity (its weights, config and the files that shape its text), the backend and the settings (another teacher or
setting gets a file of its own).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from collections.abc import Callable, Iterable
from fnmatch import fnmatch
from importlib.metadata import entry_points
from pathlib import Path

from swiftkv_core.atomic import atomic_file
from swiftkv_core.chat import ANSWER_BACKENDS, check_sampling
from swiftkv_core.checkpoints import model_identity

# A backend (an entry point of swiftkv_core.chat.ANSWER_BACKENDS, or "hf"): (checkpoint folder, prompts,
# max_new_tokens, temperature, top_p, seed) -> one answer per prompt.
Backend = Callable[[Path, list[str], int, float, float, int], list[str]]
# Beside the weights and config (``model_identity``), the files of a model folder that decide the text it answers
# with: the tokenizer and its special tokens, the chat template (the prompt), the generation config (where it stops).
TEXT_FILES = (
    "tokenizer*", "chat_template*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt",
    "generation_config.json",
)  # fmt: skip


def answers_dir() -> Path:
    from swiftkv_core.default_model import cache_dir

    return cache_dir() / "data" / "distill" / "teacher_answers"


def hf_answers(path: Path, prompts: list[str], max_new_tokens: int, temperature: float, top_p: float, seed: int,
               batch_size: int = 16, device: str = "auto") -> list[str]:  # fmt: skip
    """Answers with HF ``generate`` in batches of ``batch_size`` (seeded per batch) on ``device`` (``hf_device``):
    works wherever torch does."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from swiftkv_core.chat import chat_prompt_batch
    from swiftkv_core.checkpoints import stored_dtype
    from swiftkv_core.commands import check_weights_fit
    from swiftkv_core.generation import load_weights

    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype, device = hf_dtype(device), torch.device(hf_device(device))
    dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    # a teacher that cannot fit the device is refused before its weights are read ("auto": the stored dtype)
    check_weights_fit(str(path), device, (stored_dtype(path) or torch.float32) if dtype == "auto" else dtype)
    # straight onto the GPU where there is one: no whole copy of the teacher in host memory first
    lm = load_weights(path, dtype, device).eval()
    # temperature 0: greedy, as vLLM reads it (HF's sampling refuses it)
    sampling = (
        dict(do_sample=True, temperature=temperature, top_p=top_p)
        if temperature > 0
        else dict(do_sample=False)
    )
    answers = []
    batches = range(0, len(prompts), batch_size)
    for index, start in enumerate(tqdm(batches, desc="teacher answers (HF)", unit="batch")):
        inputs = chat_prompt_batch(tokenizer, prompts[start : start + batch_size]).to(lm.device)
        torch.manual_seed(seed + index)
        with torch.no_grad():
            generated = lm.generate(
                **inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
            )
        answers += tokenizer.batch_decode(
            generated[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        )
    return answers


def hf_device(device: str = "auto") -> str:
    """Where the HF backend generates (``swiftkv_core.runtime.choose_device``): ``"auto"`` is the GPU where one is
    visible (its samples differ from the CPU's), else ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as given."""
    from swiftkv_core.runtime import choose_device

    return str(choose_device(device))


def hf_dtype(device: str = "auto") -> str:
    """The HF backend's weights: bf16 on a GPU (an 8B teacher in fp32 would take 32 GB; fp16 where a GPU has no
    bf16); on a CPU ``"auto"``, the checkpoint's own dtype (transformers' default)."""
    import torch

    from swiftkv_core.runtime import choose_dtype

    device = torch.device(hf_device(device))
    return "auto" if device.type == "cpu" else str(choose_dtype("auto", device)).removeprefix("torch.")


def backends() -> dict[str, object]:
    """Every answer backend by name: ``"hf"`` and those of installed packages (entry points, loaded on use)."""
    return {"hf": hf_answers, **{entry.name: entry for entry in entry_points(group=ANSWER_BACKENDS)}}


def answer_backend(backend: str = "auto") -> str:
    """The backend's name: ``"auto"`` is ``"vllm"`` where that backend and vLLM are installed, else ``"hf"``."""
    available = backends()
    if backend == "auto":
        return "vllm" if "vllm" in available and importlib.util.find_spec("vllm") is not None else "hf"
    if backend not in available:
        raise ValueError(
            f"Unknown answer backend {backend!r}: installed are {sorted(available)} (or 'auto')."
        )
    return backend


def _generate(backend: str) -> Backend:
    found = backends()[backend]
    return found if callable(found) else found.load()


def _answerable(prompts: Iterable[dict]) -> list[dict]:
    return [r for r in prompts if isinstance(r.get("prompt"), str) and r["prompt"].strip()]


def teacher_answers_cache_file(
    prompts: Iterable[dict],
    model: str = "default",
    max_new_tokens: int = 160,
    batch_size: int = 16,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    backend: str = "auto",
    device: str = "auto",
) -> tuple[Path, dict]:
    """Where ``teacher_answers`` with these arguments keeps its answers, and the record of what they are (the
    model's identity, the backend, the settings, the prompts).

    The file name is keyed by a hash of that record: another model (its weights, its config or its
    ``TEXT_FILES``), backend (vLLM and HF sample differently) or setting gets a file of its own. The HF backend
    seeds per batch, so its batch size is part of the key, and its samples on a GPU differ from the CPU's, so the
    GPU and its dtype are too.
    """
    from swiftkv_core.default_model import resolve_model_path

    path = resolve_model_path(model)
    backend = answer_backend(backend)
    texts = [r["prompt"] for r in _answerable(prompts)]
    on_gpu = backend == "hf" and hf_device(device) != "cpu"
    metadata = {
        "model": model_identity(path),
        "text_files": text_files_identity(path),
        "backend": backend,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "batch_size": batch_size if backend == "hf" else None,
        **({"device": "cuda", "dtype": hf_dtype(device)} if on_gpu else {}),
        "num_prompts": len(texts),
        "prompts_sha256": hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode()).hexdigest(),
    }
    key = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode()).hexdigest()[:16]
    return answers_dir() / f"{path.name}-{backend}-{key}.jsonl", metadata


def text_files_identity(path: Path) -> dict[str, str]:
    """sha256 of each of the model folder's ``TEXT_FILES``: a teacher whose tokenizer, chat template or generation
    config changed in place answers otherwise, so its answers are not the cached ones."""
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.is_file() and any(fnmatch(f.name, pattern) for pattern in TEXT_FILES)
    }


def write_jsonl(path: Path, records: Iterable[dict]) -> Path:
    """``records`` as JSON lines at ``path``, written atomically."""
    with atomic_file(path) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def teacher_answers(
    prompts: Iterable[dict],
    model: str = "default",
    max_new_tokens: int = 160,
    batch_size: int = 16,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    backend: str = "auto",
    cache: bool = True,
    device: str = "auto",
) -> list[dict]:
    """The teacher's own answers to prompt records (``{"prompt": ...}``), as ``{"prompt", "response", "source"}``.

    ``model``: ``"default"``, a ``.gguf`` file or a local HF folder (the ORIGINAL model: the distillation
    teacher). Sampled and seeded; prompts with an empty answer are dropped. ``backend``: a name of ``backends()``
    or ``"auto"``; ``batch_size`` and ``device`` (``hf_device``) apply to ``"hf"``; another backend uses its own
    device (vLLM its build's). With ``cache``, the answers are kept under
    ``answers_dir()`` (``teacher_answers_cache_file``; a ``.meta.json`` beside each file says what it holds), and
    later calls with the same key read them instead of generating.
    """
    check_sampling(max_new_tokens, temperature, top_p)
    records = _answerable(prompts)
    texts = [r["prompt"] for r in records]
    entry, metadata = teacher_answers_cache_file(
        records, model, max_new_tokens, batch_size, temperature, top_p, seed, backend, device
    )
    path, backend = Path(metadata["model"]["path"]), metadata["backend"]
    if cache and entry.is_file():
        with entry.open(encoding="utf-8") as f:
            answers = [json.loads(line)["response"] for line in f]
    else:
        from transformers import AutoTokenizer

        from swiftkv_core.chat import require_chat_template

        require_chat_template(AutoTokenizer.from_pretrained(path))
        start = time.perf_counter()
        if backend == "hf":
            answers = hf_answers(path, texts, max_new_tokens, temperature, top_p, seed, batch_size, device)
        else:
            answers = _generate(backend)(path, texts, max_new_tokens, temperature, top_p, seed)
        if cache:
            metadata["generation_s"] = round(time.perf_counter() - start, 1)
            with atomic_file(entry.with_suffix(".meta.json")) as f:
                f.write(json.dumps(metadata, indent=2))
            write_jsonl(entry, ({"prompt": p, "response": a} for p, a in zip(texts, answers, strict=True)))
    return [
        {"prompt": record["prompt"], "response": answer.strip(), "source": record.get("source")}
        for record, answer in zip(records, answers, strict=True)
        if answer.strip()
    ]
