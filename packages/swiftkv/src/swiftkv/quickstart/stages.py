"""The main job's stages, in order (``STAGES``); each takes the run and returns its results (JSON-able), which
``Run`` records in state.json. Their order and what each does: ``swiftkv/quickstart/__init__.py``."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from math import nan
from pathlib import Path

from .run import Run, Stage
from .settings import HELDOUT_CHAT_PROMPTS

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Count from one to five.",
    "What is 12 plus 7?",
    "Give me three tips for writing clear emails.",
    "Explain in two sentences what a KV cache is in a transformer.",
]
GREEDY_TOKENS = 8  # the greedy-answer metric: the first tokens of an answer, what a user reads first
# what an interrupted distillation can lose, in training time: a step takes seconds on a CPU and a fraction of one on
# a GPU, so a cadence in steps fit for one device writes too rarely or too often on the other
CHECKPOINT_SECONDS = 60


def analyze(run: Run) -> dict:
    """Eq. 1 on a sample of the training text; the plot marks the chosen l and the threshold rule's pick."""
    from swiftkv_core.analysis import (
        layer_input_similarity,
        recommend_num_key_value_layers,
        write_similarity_report,
    )
    from swiftkv_core.generation import load
    from swiftkv_distill.data import encode_record, load_records, record_kind

    base, tokenizer = load(run.settings.model_identity["path"], dtype=run.dtype, device=run.device)
    records = load_records(run.results["teacher_answers"]["train_files"])
    texts = [r["text"] for r in records if record_kind(r) == "text"][:400]
    # training data of chat records only: as the model reads them (its chat template)
    texts = texts or [tokenizer.decode(encode_record(r, tokenizer)[0]) for r in records[:400]]
    texts = ["\n\n".join(texts[i : i + 25]) for i in range(0, len(texts), 25)][:8]
    similarity = layer_input_similarity(base, tokenizer, texts, max_length=512)
    result = write_similarity_report(
        similarity,
        run.settings.threshold,
        run.path("analysis"),
        title=f"{Path(run.settings.model_identity['path']).name}: layer input similarity",
        chosen=run.num_key_value_layers,
    )
    l, rule = (
        run.num_key_value_layers,
        recommend_num_key_value_layers(similarity, run.settings.threshold),
    )
    # defined up to l = L - 2: the last layer's input has no later layer's input to be like
    at_l = f"{similarity[l]:.3f}" if l < len(similarity) else "n/a (the last layer)"
    print(f"   similarity at l={l}: {at_l}; the threshold rule ({run.settings.threshold}) picks l={rule}")
    return {**result, "chosen": l, "plot": "analysis/similarity.png"}


def frontier(run: Run) -> dict:
    """The quality/speed frontier: per l of a sweep, the least-squares init on the held-out sets, the FLOPs bound and
    the KV bytes; with l 'auto', the smallest l predicted to clear --min_agreement after distillation."""
    from .frontier import choose, measure, sweep

    s = run.settings
    given = s.num_key_value_layers if isinstance(s.num_key_value_layers, int) else None
    num_layers = json.loads((Path(s.model_identity["path"]) / "config.json").read_text())["num_hidden_layers"]
    rows = measure(run, sweep(num_layers, s.key_value_group_size, given))
    chosen, reason = (given, "given") if given else choose(rows, s.min_agreement)
    for r in rows:
        held = ", ".join(f"{name} {r[name]['agreement']:.1%} (predicted distilled {r['predicted'][name]:.1%})"
                         for name in r["predicted"])  # fmt: skip
        print(f"   l={r['l']:>3}: FLOPs bound {r['flops_bound_x']:.2f}x, init agreement {held}", flush=True)
    if not given:
        print(f"   l = {chosen}: {reason}", flush=True)
    return {"rows": rows, "chosen": chosen, "reason": reason, "min_agreement": s.min_agreement}


def convert(run: Run) -> dict:
    """SwiftKV at l (and g), its K/V projections fitted to the teacher's by least squares on training data."""
    from transformers import AutoTokenizer

    from swiftkv_core.convert import convert as convert_model
    from swiftkv_core.convert import save_checkpoint

    from .frontier import fit_kv_init

    s = run.settings
    path = s.model_identity["path"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = convert_model(path, run.num_key_value_layers, s.key_value_group_size).to(run.device)
    report = fit_kv_init(run, model, tokenizer)
    save_checkpoint(model.cpu(), run.path("converted"), tokenizer)
    print(
        f"   least-squares K/V init on {int(report['tokens'])} tokens: teacher K/V energy explained "
        f"{report['explained_mean']:.3f} on average, {report['explained_min']:.3f} at worst"
    )
    return {"checkpoint": "converted", **{k: v for k, v in report.items() if not k.startswith("explained/")}}


def teacher_answers(run: Run) -> dict:
    """The teacher's own answers to chat prompts (vLLM where installed, on its own device; else HF on the run's
    device; cached by the teacher's identity): the training files' ``dataset:chat_answers`` and the held-out chat
    set the evaluations compare against, both copied into the run (a run continued without the cache, cleared or
    in a container without its volume, trains on the same rows: a sampled answer made again would differ)."""
    import shutil

    from swiftkv_distill.answers import answer_backend, write_jsonl
    from swiftkv_distill.answers import teacher_answers as answer_prompts
    from swiftkv_distill.corpora import dataset_name, prepare, resolve_files
    from swiftkv_distill.data import load_records

    s = run.settings
    teacher, device = s.model_identity["path"], run.device.type
    started = time.perf_counter()
    # dataset:chat_answers is answered by the teacher, once (cached)
    train_files = resolve_files(s.train_files, teacher, device)
    answered = [i for i, entry in enumerate(s.train_files) if dataset_name(entry) == "chat_answers"]
    for i in answered:
        train_files[i] = str(shutil.copyfile(train_files[i], run.path(Path(train_files[i]).name)))
    result = {"train_files": train_files}
    if s.heldout_chat_prompts:
        if s.heldout_chat_prompts == HELDOUT_CHAT_PROMPTS:  # answered with the training prompts, in one go
            answers = load_records([prepare("chat_answers_heldout", teacher, device)])
        else:
            prompts = load_records(resolve_files([s.heldout_chat_prompts]))
            answers = answer_prompts([r for r in prompts if r.get("prompt")], model=teacher, device=device)
        write_jsonl(run.path("chat_heldout.jsonl"), answers)
        result.update(file="chat_heldout.jsonl", answers=len(answers))
    if s.heldout_chat_prompts or answered:
        # answered by vLLM where installed (on the device its build targets), else by HF generate on the run's device
        by = "vLLM, on its build's device" if answer_backend() == "vllm" else f"HF generate on {device}"
        took = time.perf_counter() - started
        print(f"   teacher answers ready in {took:.0f} s (those not in the cache answered by {by})")
    return result


def distill(run: Run) -> dict:
    """Lightning distillation of the converted model for --budget_minutes of training (the recipe's settings, through
    ``swiftkv_distill.recipe``); resumes from its last checkpoint if interrupted; the full and serving exports."""
    from swiftkv_distill.export import export_checkpoints
    from swiftkv_distill.recipe import budgeted_fit

    s = run.settings
    val_files = {"text": s.heldout_text}
    if run.path("chat_heldout.jsonl").is_file():
        val_files["chat"] = [str(run.path("chat_heldout.jsonl"))]
    overrides = {
        "model.model": str(run.path("converted")),
        "model.num_key_value_layers": run.num_key_value_layers,
        "model.key_value_group_size": s.key_value_group_size,
        "data.train_files": run.results["teacher_answers"]["train_files"],
        "data.val_files": val_files,
        "data.max_val_rows": s.max_eval_rows,
        "trainer.accelerator": s.accelerator,
        # one process on one device, whatever the recipe's launch (an 8-GPU recipe's FSDP2 strategy too)
        "trainer.devices": 1,
        "trainer.strategy": "auto",
    }
    built, summary = budgeted_fit(
        s.recipe,
        run.path("distill"),
        s.budget_minutes * 60,
        overrides,
        checkpoint_seconds=CHECKPOINT_SECONDS,
    )
    export_checkpoints(built.module, {run.path("distilled"): False, run.path("distilled-serving"): True})
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
                  f"ppl {m.get('student_ppl', nan):.1f} (teacher {m.get('teacher_ppl', nan):.1f})",
                  flush=True)  # fmt: skip
    return {
        "steps": summary["global_step"],
        "precision": str(built.trainer.precision),
        "train_seconds": summary["train_seconds"],
        "train_tokens": summary["train_tokens"],
        "resumed": summary["resumed"],
        "metrics": metrics,
        "metrics_csv": "distill/logs/version_0/metrics.csv",
        "plot": "distill/logs/version_0/metrics.png",
    }


def evaluate(run: Run) -> dict:
    """What a chat user sees: greedy answers of teacher and SwiftKV side by side, and over the held-out chat
    prompts, how often the first 8 tokens of the greedy answers equal the teacher's (converted vs distilled)."""
    from swiftkv_distill.data import load_records

    from .evaluation import greedy_answers, greedy_prefix_agreement

    answers = greedy_answers(run.path("distilled"), CHAT_PROMPTS, device=run.device, dtype=run.dtype)
    result = {"prompts": CHAT_PROMPTS, "answers": answers}
    if run.path("chat_heldout.jsonl").is_file():
        prompts = [r["prompt"] for r in load_records([str(run.path("chat_heldout.jsonl"))])]
        checkpoints = {name: run.path(name) for name in ("converted", "distilled")}
        result["greedy_prefix"] = greedy = greedy_prefix_agreement(
            checkpoints, prompts, tokens=GREEDY_TOKENS, device=run.device, dtype=run.dtype
        )
        shares = ", ".join(f"{name} {share:.1%}" for name, share in greedy["share"].items())
        print(f"   greedy answers to {len(prompts)} held-out chat prompts, first {GREEDY_TOKENS} tokens equal to the "
              f"teacher's: {shares}")  # fmt: skip
    return result


def prefill(run: Run) -> dict:
    """HF prefill latency (cache on, last logits only, as generate) over prompt lengths, SwiftKV off vs on. On a GPU
    the whole forward is compiled with CUDA graphs (``compile_prefill``, its logits checked against eager's first):
    eager, a small model's GPU prefill is bound by kernel launches (the same time at 512 and 2048 tokens on an H100),
    which hides the FLOPs SwiftKV saves. Where compiling fails, the stage says why and times the eager forward."""
    import torch
    from tqdm.auto import tqdm

    from swiftkv_core.flops import ModelShape, prefill_flops_total
    from swiftkv_core.generation import (
        check_compiled_prefill,
        compile_prefill,
        load,
        sample_prompt_ids,
        time_prefill_off_on,
    )
    from swiftkv_core.runtime import device_description

    model, tokenizer = load(run.path("distilled"), dtype=run.dtype, device=run.device)
    shape, l, g = (
        ModelShape.from_config(model.config),
        run.num_key_value_layers,
        run.settings.key_value_group_size,
    )
    compiled = compile_prefill(model) if run.device.type == "cuda" else None
    rows = []
    torch.manual_seed(0)
    for length in tqdm(run.settings.prompt_lengths, desc="   prefill lengths", unit="length"):
        ids = sample_prompt_ids(tokenizer, length).to(run.device)
        measured = None
        if compiled is not None:
            try:  # checked and timed: a CUDA graph is recorded and replayed in both (its memory pool may not fit)
                check_compiled_prefill(model, compiled, ids)
                measured = time_prefill_off_on(model, ids, repeats=3, warmup=3, forward=compiled)
            except Exception as error:  # a timing stage: fall back to eager, never lose the run
                print(f"   the compiled prefill failed at {length} tokens ({type(error).__name__}: {error}); "
                      "timing the eager forward", flush=True)  # fmt: skip
                compiled = None
                torch.compiler.reset()  # its graphs and their memory
        if measured is None:
            measured = time_prefill_off_on(model, ids, repeats=3, warmup=1)
        times = {k: sorted(v)[1] for k, v in measured.items()}  # medians
        bound = prefill_flops_total(shape, length) / prefill_flops_total(shape, length, l, g)
        rows.append({"prompt_tokens": length, "off_s": times[False], "on_s": times[True],
                     "speedup_x": times[False] / times[True], "flops_bound_x": bound,
                     "forward": "compiled, CUDA graphs" if compiled is not None else "eager"})  # fmt: skip
    from .report import ABOVE_BOUND, DISTURBED

    for r in rows:
        # the speed-up stays within a few percent of its FLOPs bound (L / l at most, were the later layers' K/V
        # free): a row well past it was timed while something else ran
        r["above_bound"] = r["speedup_x"] > ABOVE_BOUND * r["flops_bound_x"]
        print(f"   {r['prompt_tokens']:>5} tokens: {r['off_s'] * 1e3:7.1f} -> {r['on_s'] * 1e3:7.1f} ms, "
              f"{r['speedup_x']:.2f}x (FLOPs bound {r['flops_bound_x']:.2f}x; {r['forward']})"
              f"{DISTURBED if r['above_bound'] else ''}")  # fmt: skip
    return {"rows": rows, "threads": torch.get_num_threads(), "device": run.device_description(),
            "device_name": device_description(run.device)}  # fmt: skip


def serve(run: Run) -> dict:
    """vLLM: the base checkpoint (stock) vs the distilled serving export (plugin), same prompts and settings."""
    s = run.settings
    if not s.serve:
        return {"skipped": "--serve false"}
    from swiftkv_serve.comparison import compare_serving

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
    from .report import in_words

    for w, r in results["ratios_swiftkv_over_stock"].items():
        print(f"   {w}: throughput {r['combined_throughput_x']:.2f}x, TTFT {in_words(r['ttft_lower_x'])}, "
              f"TPOT {in_words(r['tpot_lower_x'])}")  # fmt: skip
    return results


def task_accuracy(run: Run) -> dict:
    """lm-evaluation-harness on the teacher and the distilled model (``swiftkv eval``), with --eval_tasks."""
    s = run.settings
    if not s.eval_tasks:
        return {"skipped": "no --eval_tasks (offline: --eval_tasks '[swiftkv_capitals, swiftkv_arithmetic]')"}
    from ..evaluate import beside
    from ..evaluate import main as evaluate

    markdown = evaluate(run.path("distilled"), s.eval_tasks, device=run.device.type, out=run.path("eval"))
    return {
        "file": str(markdown.relative_to(run.root)),
        **json.loads(beside(run.path("eval"), ".json").read_text()),
    }


def report(run: Run) -> dict:
    """``report.md`` (headline first, tables, plots inline), ``report.json`` and the plots."""
    from swiftkv_core.runtime import device_description, stack_versions

    from .report import write_run_report

    versions = stack_versions()
    paths = write_run_report(run.root, asdict(run.settings), run.results, versions)
    return {"files": [str(p.relative_to(run.root)) for p in paths], "versions": versions,
            "machine": device_description("cpu"), "device": run.device_description()}  # fmt: skip


STAGES = [
    Stage("teacher_answers", teacher_answers),
    Stage("frontier", frontier),
    Stage("analyze", analyze),
    Stage("convert", convert),
    Stage("distill", distill),
    Stage("evaluate", evaluate),
    Stage("prefill", prefill),
    Stage("serve", serve),
    Stage("task_accuracy", task_accuracy),
    Stage("report", report),
]
