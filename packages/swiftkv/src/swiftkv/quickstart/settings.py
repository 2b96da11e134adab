"""The main job's settings, every one checked before any compute: a bad model, family, ``l`` / ``g``, budget, data
file or workload is refused here with the fix in the message."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path

ACCELERATORS = ("auto", "cpu", "gpu")
# per device: the shipped recipe (swiftkv_distill/recipes/, SmolLM2-135M-Instruct) and the training budget
DEVICE_DEFAULTS = {
    "cpu": {"recipe": "smollm2-135m-cpu", "budget_minutes": 12.0},
    "gpu": {"recipe": "smollm2-135m-gpu", "budget_minutes": 4.0},
}
HELDOUT_CHAT_PROMPTS = "dataset:chat_prompts_heldout"  # answered together with dataset:chat_answers
DEFAULT_PROMPT_LENGTHS = [256, 512, 1024, 2048, 4096]
DEFAULT_WORKLOADS = ["2000/200", "500/500"]
# what the serving stage imports, and what to call it: the plugin can be importable without vLLM (a source tree on
# PYTHONPATH, or swiftkv-serve installed without its [cpu] / [cuda] extra)
SERVING_NEEDS = (("swiftkv_serve", "the swiftkv-serve package"), ("vllm", "vLLM"))


class QuickstartError(ValueError):
    """Bad input, found before any compute; the message says how to fix it."""


@dataclass
class Settings:
    """Everything that decides a run's results (a rerun with other settings needs --force or another --out, but for
    those one stage alone reads: ``run.STAGE_SETTINGS``)."""

    model: str
    accelerator: str  # "cpu" or "gpu": where the HF stages and the distillation run (vLLM: its build's)
    num_key_value_layers: int | str  # an l, or "auto": the frontier stage picks it (run.num_key_value_layers)
    key_value_group_size: int
    budget_minutes: float
    recipe: str
    train_files: list[str]
    heldout_text: list[str]
    heldout_chat_prompts: str
    max_eval_rows: int
    prompt_lengths: list[int]
    serve: bool
    serve_workloads: list[str]
    serve_requests: int
    serve_compile: bool
    threshold: float
    min_agreement: float = 0.85
    eval_tasks: list[str] = field(default_factory=list)
    model_identity: dict = field(default_factory=dict)
    # the recipe file's and the local data files' sha256: an edited one makes another run
    input_files: dict = field(default_factory=dict)


def check(
    model: str,
    out: Path | None,
    accelerator: str,
    num_key_value_layers: int | str | None,
    key_value_group_size: int,
    budget_minutes: float | None,
    recipe: str | None,
    train_files: list[str] | None,
    heldout_text: list[str] | None,
    heldout_chat_prompts: str,
    max_eval_rows: int,
    prompt_lengths: list[int] | None,
    serve: bool | None,
    serve_workloads: list[str] | None,
    serve_requests: int,
    serve_compile: bool,
    threshold: float,
    eval_tasks: list[str] | None = None,
    min_agreement: float = 0.85,
) -> tuple[Settings, Path]:
    """The run's settings and output folder, or ``QuickstartError`` (nothing is computed or written here)."""
    import torch

    from swiftkv_core.checkpoints import CheckpointError, check_checkpoint, model_identity
    from swiftkv_core.runtime import gpu_computes_bf16
    from swiftkv_distill.corpora import DATASETS, dataset_name
    from swiftkv_distill.data import DataError, load_records
    from swiftkv_distill.recipe import RecipeError, parse, recipe_path

    from .frontier import sweep as frontier_sweep

    cuda = torch.cuda.is_available()
    bf16 = cuda and gpu_computes_bf16()
    gpu_name = torch.cuda.get_device_name() if cuda else None
    if note := cpu_fallback_note(accelerator, cuda, bf16, torch.version.cuda, gpu_name):
        print(note)
    accelerator = choose_accelerator(accelerator, cuda, bf16, torch.version.cuda)
    recipe = recipe or DEVICE_DEFAULTS[accelerator]["recipe"]
    budget_minutes = (
        DEVICE_DEFAULTS[accelerator]["budget_minutes"] if budget_minutes is None else budget_minutes
    )
    try:
        path, config = check_checkpoint(model, kind="base")
    except CheckpointError as error:
        raise QuickstartError(f"--model {error}") from None
    try:
        recipe_path(recipe)
        recipe_settings = parse(recipe)
    except RecipeError as error:
        raise QuickstartError(f"--recipe: {error}") from None
    L = config.num_hidden_layers
    defaulted = num_key_value_layers is None
    l = default_num_key_value_layers(str(model), L, recipe_settings) if defaulted else num_key_value_layers
    g = key_value_group_size
    if isinstance(l, str) and l != "auto":
        raise QuickstartError(
            f"--num_key_value_layers {l!r}: an integer l, or 'auto' (the frontier picks it)."
        )
    if not 0 < min_agreement < 1:
        raise QuickstartError(f"--min_agreement {min_agreement}: a share of tokens in (0, 1), e.g. 0.85.")
    if not 0 < threshold <= 1:
        raise QuickstartError(
            f"--threshold {threshold}: a cosine similarity in (0, 1], e.g. 0.9 (the paper's)."
        )
    if max_eval_rows < 0:
        raise QuickstartError(
            f"--max_eval_rows {max_eval_rows}: held-out rows per evaluation, >= 0 (0: all)."
        )
    if serve_requests < 1:
        raise QuickstartError(f"--serve_requests {serve_requests}: requests per burst, a positive integer.")
    if any(n < 1 for n in prompt_lengths or []):
        raise QuickstartError(
            f"--prompt_lengths {prompt_lengths}: prompt token counts, each a positive integer."
        )
    # auto: checked at L/2 with g = 1; the frontier picks an l that g fits
    layers = (L // 2, 1) if l == "auto" else (l, g)
    try:
        check_checkpoint(path, *layers, kind="base")
        if l == "auto" and not frontier_sweep(L, g, None):
            raise CheckpointError(f"no l in [{L // 2}, {L - 1}] fits key_value_group_size={g}")
    except CheckpointError as error:
        why = f" (l was not given: {l} is the default for this model)" if defaulted else ""
        raise QuickstartError(f"--num_key_value_layers / --key_value_group_size{why}: {error}") from None
    data = recipe_settings.data
    train_files = list(train_files or data.train_files or [])
    if not train_files:
        raise QuickstartError(
            f"--recipe {recipe} names no data.train_files: give them there, or --train_files."
        )
    val_files = data.val_files
    heldout_text = list(
        heldout_text or (next(iter(val_files.values())) if isinstance(val_files, dict) else val_files) or []
    )
    if not heldout_text:
        raise QuickstartError(
            f"--recipe {recipe} names no held-out text (data.val_files) to evaluate on: give --heldout_text."
        )
    named = [
        f for f in train_files + heldout_text + [heldout_chat_prompts] if f and dataset_name(f) is not None
    ]
    if unknown := [f for f in named if dataset_name(f) not in DATASETS]:
        raise QuickstartError(
            f"{unknown}: unknown data set(s); name one of {[f'dataset:{n}' for n in DATASETS]}, or give a file."
        )
    if not _has_chat_template(path):  # a base model: no chat to distil or evaluate
        chat = [f for f in train_files if (dataset_name(f) or "").startswith("chat_")]
        if chat:
            print(f"note: {model} has no chat template (a base model): training on text only, without {chat}")
        train_files = [f for f in train_files if f not in chat]
        heldout_chat_prompts = ""
    for option, files in (("--train_files", train_files), ("--heldout_text", heldout_text)):
        if not all(f.strip() for f in files):
            raise QuickstartError(
                f"{option} {files}: an empty file name; give the files, or leave the option out."
            )
    local = [f for f in train_files + heldout_text + [heldout_chat_prompts] if f and dataset_name(f) is None]
    for name in local:
        if not Path(name).is_file():
            raise QuickstartError(
                f"data file {name}: not found (give a local jsonl / parquet / txt, or dataset:NAME)."
            )
    try:  # every record readable and of a known kind, before any compute
        records = {name: load_records([name]) for name in dict.fromkeys(local)}
    except DataError as error:
        raise QuickstartError(str(error)) from None
    # the teacher answers the held-out chat prompts: a named set of chat prompts, or a file with prompt records
    named, prompts = dataset_name(heldout_chat_prompts or ""), records.get(heldout_chat_prompts)
    if (named and not named.startswith("chat_")) or (
        prompts is not None and not any(r.get("prompt") for r in prompts)
    ):
        raise QuickstartError(
            f"--heldout_chat_prompts {heldout_chat_prompts}: no {{'prompt': ...}} record for the teacher to answer; "
            "give a jsonl of prompt records, or '' to skip the chat evaluation."
        )
    data_settings = {
        "train_files": train_files,
        "val_files": {"text": heldout_text},
        "max_val_rows": max_eval_rows,
    }
    _check_recipe_values(recipe, recipe_settings, path, *layers, data_settings)
    if not recipe_settings.model.evaluate_before_training or recipe_settings.trainer.limit_val_batches == 0:
        raise QuickstartError(
            f"--recipe {recipe}: model.evaluate_before_training false or trainer.limit_val_batches 0 turns off the "
            "held-out evaluation before or after training, which the main job's report compares: remove them from "
            "the recipe (swiftkv distill fit trains without the evaluation)."
        )
    if 0 < data.max_train_rows < data.batch_size:
        raise QuickstartError(
            f"--recipe {recipe}: data.max_train_rows {data.max_train_rows} makes no batch of data.batch_size "
            f"{data.batch_size}: raise it, or 0 for every row."
        )
    _check_local_data(path, records, train_files, heldout_text, data)
    step_seconds = estimated_step_seconds(config, data.batch_size * data.max_length, accelerator)
    if not budget_minutes * 60 >= step_seconds:
        raise QuickstartError(
            f"--budget_minutes {budget_minutes}: too small to run one distillation step, which takes about "
            f"{step_seconds:.0f} s for this model and recipe on this machine; give at least "
            f"{math.ceil(step_seconds / 6) / 10:.1f}."
        )
    context = getattr(config, "max_position_embeddings", 4096)
    if too_long := [n for n in prompt_lengths or [] if n > context]:
        raise QuickstartError(
            f"--prompt_lengths {too_long}: beyond the model's context ({context} tokens); give shorter prompts."
        )
    # a model whose context is shorter than every default: its whole context, prompt-heavy (10:1) to serve
    lengths = sorted(n for n in (prompt_lengths or DEFAULT_PROMPT_LENGTHS) if n <= context) or [context]
    workloads = list(
        serve_workloads
        or [w for w in DEFAULT_WORKLOADS if _workload_tokens(w) <= context]
        or [f"{context * 10 // 11}/{context - context * 10 // 11}"]
    )
    for workload in workloads if serve is not False else []:
        prompt, _, output = workload.partition("/")
        if not (prompt.isdigit() and output.isdigit()) or min(int(prompt), int(output)) < 1:
            raise QuickstartError(
                f"--serve_workloads {workload}: write PROMPT/OUTPUT token counts, each >= 1 (e.g. 2000/200)."
            )
        if _workload_tokens(workload) > context:
            raise QuickstartError(
                f"--serve_workloads {workload}: {_workload_tokens(workload)} tokens, beyond the model's context "
                f"({context}); give a shorter workload."
            )
    if eval_tasks and importlib.util.find_spec("lm_eval") is None:
        raise QuickstartError("--eval_tasks needs lm-evaluation-harness: pip install 'swiftkv[eval]'.")
    if eval_tasks:  # known to lm-eval, before the run (indexing its task files takes 10-20 s on a 2-core CPU)
        from ..evaluate import check_task_names, task_index

        with task_index() as task_manager:
            try:
                check_task_names(eval_tasks, task_manager, "--eval_tasks")
            except ValueError as error:
                raise QuickstartError(str(error)) from None
    missing = next((what for module, what in SERVING_NEEDS if importlib.util.find_spec(module) is None), None)
    if serve and missing:
        raise QuickstartError(
            f"--serve true needs {missing}, not installed here: pip install 'swiftkv-serve[cpu]' (or [cuda] on a "
            "GPU), or --serve false."
        )
    if serve is None:
        serve = missing is None
        if missing:
            print(f"note: {missing} is not installed here: the serving stage is skipped (--serve false)")
    settings = Settings(
        model=str(model), accelerator=accelerator, num_key_value_layers=l, key_value_group_size=g, budget_minutes=budget_minutes,
        recipe=str(recipe), train_files=train_files, heldout_text=heldout_text,
        heldout_chat_prompts=heldout_chat_prompts, max_eval_rows=max_eval_rows, prompt_lengths=lengths,
        serve=serve, serve_workloads=workloads, serve_requests=serve_requests, serve_compile=serve_compile,
        threshold=threshold, min_agreement=min_agreement, eval_tasks=list(eval_tasks or []),
        model_identity=model_identity(path),
        input_files=_digests([recipe_path(recipe), *local]),
    )  # fmt: skip
    name = (
        path.name if model in ("default", None) else Path(model).resolve().name.removesuffix(".gguf")
    ).lower()
    default_out = Path("runs") / (f"{name}-l{l}" + ("" if g == 1 else f"-g{g}"))
    return settings, Path(out) if out is not None else default_out


def _workload_tokens(workload: str) -> int:
    """The tokens of a serving workload ``PROMPT/OUTPUT`` whose counts are numbers (else 0: checked apart)."""
    prompt, _, output = workload.partition("/")
    return int(prompt) + int(output) if prompt.isdigit() and output.isdigit() else 0


def _digests(files) -> dict:
    """``{resolved path: sha256 of its bytes}`` of ``files`` (a recipe, data files: read once, at the start)."""
    import hashlib

    digests = {}
    for name in files:
        with open(name, "rb") as f:
            digests[str(Path(name).resolve())] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


def default_num_key_value_layers(model: str, num_layers: int, recipe_settings) -> int:
    """l when none is given: the recipe's own where the recipe is for this model (its l was measured there), else
    half the layers (the published choice: prefill compute halves). The same model named two ways (``default``
    and the embedded folder's path, or a path with ``..``) is the same model."""
    if _same_model(model, str(recipe_settings.model.model)):
        return int(recipe_settings.model.num_key_value_layers)
    return num_layers // 2


def _same_model(model: str, other: str) -> bool:
    """Whether two model names lead to one checkpoint folder; a ``.gguf`` is compared by its own path (resolving
    one would materialise it)."""
    from swiftkv_core.default_model import resolve_model_path

    if model == other:
        return True
    if model.endswith(".gguf") or other.endswith(".gguf"):
        return Path(model).resolve() == Path(other).resolve()
    try:
        return resolve_model_path(model).resolve() == resolve_model_path(other).resolve()
    except (OSError, ValueError):
        return False


def _check_local_data(
    path: Path, records: dict[str, list[dict]], train_files: list[str], heldout_text: list[str], data
) -> None:
    """Local files (a named data set holds thousands of rows), tokenised only as far as each check needs: the
    training and held-out records have a token to score (``encode_record``'s flags), and the training records make
    one batch of the recipe's rows (else the distillation runs no step) and one row of the K/V fit (packed rows hold
    ``max_length`` tokens each, unpacked rows one record each)."""
    from transformers import AutoTokenizer

    from swiftkv_core.kv_init import ROW_TOKENS
    from swiftkv_distill.data import encode_record

    tokenizer = AutoTokenizer.from_pretrained(path)

    def encoded(files: list[str]):
        try:
            for record in (r for f in files for r in records[f]):
                yield encode_record(record, tokenizer, data.chat_tokens)
        except ValueError as error:  # a chat record for a tokenizer without a chat template
            raise QuickstartError(f"{files}: {error}") from None

    for option, files in (("--train_files", train_files), ("--heldout_text", heldout_text)):
        if all(f in records for f in files) and not any(any(flags) for _, flags in encoded(files)):
            raise QuickstartError(
                f"{option} {files}: no record has a token to score (chat records without an assistant turn): give "
                "text, prompt / response or answered chat records."
            )
    if not all(f in records for f in train_files):
        return
    rows = tokens = 0
    for ids, _ in encoded(train_files):
        tokens += len(ids)
        rows = math.ceil(tokens / data.max_length) if data.pack else rows + bool(ids)
        if rows >= data.batch_size and tokens >= ROW_TOKENS:
            return
    if rows < data.batch_size:
        needed = max((data.batch_size - 1) * data.max_length + 1, ROW_TOKENS) if data.pack else None
        why = (
            f"make {rows} row(s) of up to {data.max_length} tokens, too few for one batch (data.batch_size "
            f"{data.batch_size})"
        )
        more = f"{needed} tokens" if needed else f"{data.batch_size} records"
        fix = f"give at least {more} of training data, or a recipe with a smaller data.batch_size"
    else:
        why = f"are fewer than one row of the K/V fit ({ROW_TOKENS} tokens)"
        fix = f"give at least {ROW_TOKENS} tokens of training data"
    raise QuickstartError(f"the training data {train_files}: {tokens} tokens {why}: {fix}.")


def _check_recipe_values(recipe: str, settings, path: Path, l: int, g: int, data: dict) -> None:
    """The recipe's module and data settings, with the run's own (``data``: its training and held-out files),
    checked by their classes as the distillation will build them (nothing is read but the model's config)."""
    from swiftkv_distill import DistillDataModule, SwiftKVDistillation

    layers = {"model": str(path), "num_key_value_layers": l, "key_value_group_size": g}
    try:
        SwiftKVDistillation(**settings.model.as_dict() | layers)
        DistillDataModule(**settings.data.as_dict() | data | {"model": str(path)})
    except ValueError as error:  # DataError too
        raise QuickstartError(f"--recipe {recipe}: {error}") from None


def choose_accelerator(requested: str, cuda_available: bool, bf16: bool = True, cuda_build=...) -> str:
    """``"cpu"`` or ``"gpu"``: ``auto`` is the GPU where one is visible and computes in bf16 (``bf16``: compute
    capability 8.0 or more, as the GPU recipe's bf16-mixed training needs; a V100 or T4 has none). ``cuda_build``:
    the CUDA version torch is built for (None: a CPU build; default: this torch's), named when a GPU asked for is
    not visible."""
    if requested not in ACCELERATORS:
        raise QuickstartError(f"--accelerator {requested!r}: choose one of {list(ACCELERATORS)}.")
    if requested == "gpu" and not cuda_available:
        from swiftkv_core.runtime import why_no_gpu

        reason = why_no_gpu() if cuda_build is ... else why_no_gpu(cuda_build)
        raise QuickstartError(
            f"--accelerator gpu: no CUDA GPU is visible here: {reason}. "
            "Run with --accelerator cpu (or auto), or on a GPU machine (docker run --gpus all swiftkv-train:cuda "
            "swiftkv quickstart)."
        )
    if requested == "gpu" and not bf16:
        raise QuickstartError(
            "--accelerator gpu: this GPU has no bf16 (compute capability below 8.0, as a V100 or T4), which the GPU "
            "recipe trains in (bf16-mixed). Run with --accelerator cpu (auto picks it on this machine), or on an "
            "A100, L4, H100 or newer."
        )
    return "gpu" if requested == "gpu" or (requested == "auto" and cuda_available and bf16) else "cpu"


def cpu_fallback_note(
    requested: str, cuda_available: bool, bf16: bool, cuda_build: str | None, gpu_name: str | None
) -> str | None:
    """Why ``--accelerator auto`` runs on the CPU where a GPU was likely meant (a GPU without bf16; torch built for
    CUDA but seeing no GPU: no ``--gpus all``, or a host driver too old for torch's CUDA), or None."""
    if requested != "auto":
        return None
    if cuda_available and not bf16:
        return f"note: {gpu_name} has no bf16 (the GPU recipe's precision): running on the CPU"
    if not cuda_available and cuda_build:
        from swiftkv_core.runtime import why_no_gpu

        return f"note: running on the CPU: {why_no_gpu(cuda_build)}"
    return None


def estimated_step_seconds(config, tokens: int, accelerator: str = "cpu") -> float:
    """A distillation step of ``tokens`` tokens, roughly: teacher suffix + student forward/backward ~ 6 x params x
    tokens, at a conservative rate: 50 GFLOP/s on a CPU (a small CPU's fp32 matmul rate, a few times below its
    peak), 20 TFLOP/s on a GPU (far below any data-centre GPU's bf16 peak)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    params = layers * 12 * hidden * hidden + config.vocab_size * hidden
    return 6 * params * tokens / (20e12 if accelerator == "gpu" else 50e9)


def _has_chat_template(path) -> bool:
    from transformers import AutoTokenizer

    return bool(getattr(AutoTokenizer.from_pretrained(path), "chat_template", None))
