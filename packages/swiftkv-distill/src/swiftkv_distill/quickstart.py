"""The main job (`swiftkv quickstart`, `make quickstart`): SmolLM2-135M-Instruct -> SwiftKV at l=15 -> distilled.

Steps, each printed as it runs:
  1. materialise the embedded SmolLM2-135M-Instruct (once) and distil its SwiftKV version at l=15 of 30 layers
     with the CPU recipe `configs/distill/smollm2-135m-cpu.yaml` (about 21 minutes on 2 cores; Lightning logs,
     held-out KL / agreement before and after, a metrics PNG, HF checkpoints exported atomically);
  2. greedy answers to a few chat prompts from the original model and the distilled SwiftKV model;
  3. prefill latency of a 2048-token prompt, SwiftKV on vs off, measured in the same run.

    swiftkv quickstart                      # the full job, from the repository root
    swiftkv quickstart --max_steps 20       # a short smoke run (quality will be lower)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

RECIPE = Path("configs/distill/smollm2-135m-cpu.yaml")  # relative to the repository root
PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear emails.",
    "Explain in two sentences what a KV cache is in a transformer.",
]


def distil(recipe: Path, max_steps: int | None) -> None:
    """Run the CPU distillation recipe (its outputs go to the recipe's ``default_root_dir``)."""
    from .cli import main as distill_main

    args = ["fit", "--config", str(recipe)]
    if max_steps is not None:
        args += ["--trainer.max_steps", str(max_steps), "--trainer.val_check_interval", str(max_steps)]
    distill_main(args)


def chat_ids(tokenizer, prompt: str) -> dict:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )


@torch.inference_mode()
def answers(model, tokenizer, max_new_tokens: int = 48) -> list[str]:
    out = []
    for prompt in PROMPTS:
        ids = chat_ids(tokenizer, prompt)
        generated = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(
            tokenizer.decode(generated[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        )
    return out


def main(recipe: Path = RECIPE, max_steps: int | None = None, skip_distill: bool = False) -> None:
    """Distil SmolLM2 at l=15 on this CPU, then compare answers and prefill latency.

    Args:
        recipe: The distillation recipe (its paths are relative to the folder this runs in).
        max_steps: Override the recipe's optimizer steps (a shorter run for a quick look).
        skip_distill: Reuse the export of an earlier run.
    """
    from omegaconf import OmegaConf

    from swiftkv_core.generation import load, sample_prompt_ids, time_prefill

    if not Path(recipe).is_file():
        raise SystemExit(
            f"swiftkv quickstart: no recipe at {recipe}: run it from the repository root, or --recipe."
        )
    run_dir = Path(OmegaConf.load(recipe).trainer.default_root_dir)
    export_dir = run_dir / "export/hf"  # written by the recipe's ExportHF callback
    started = time.perf_counter()
    print(f"== 1/3 distillation ({recipe})", flush=True)
    if not skip_distill:
        distil(recipe, max_steps)
    if not (export_dir / "config.json").is_file():
        raise FileNotFoundError(f"No distilled checkpoint in {export_dir}: run without --skip_distill first.")
    summaries = sorted(run_dir.rglob("summary.json"), key=lambda p: p.stat().st_mtime)
    if summaries:
        summary = json.loads(summaries[-1].read_text())
        stages = (("before", "converted"), ("init", "least-squares K/V init"), ("after", "distilled"))
        for stage, what in stages:
            if summary.get(stage):
                print(f"   {what:>22}: " + ", ".join(f"{k} {v:.4g}" for k, v in summary[stage].items()))

    print("== 2/3 answers: original SmolLM2 vs distilled SwiftKV (l=15/30)", flush=True)
    teacher, tokenizer = load("default")
    student, _ = load(export_dir)
    for prompt, a, b in zip(PROMPTS, answers(teacher, tokenizer), answers(student, tokenizer), strict=True):
        print(f"   Q: {prompt}\n   original: {a}\n   SwiftKV : {b}\n")

    print(
        "== 3/3 prefill latency of a 2048-token prompt, the distilled model with SwiftKV off / on", flush=True
    )
    ids = sample_prompt_ids(tokenizer, 2048)
    off = time_prefill(student.swiftkv(False), ids)
    on = time_prefill(student.swiftkv(True), ids)
    print(f"   SwiftKV off {off * 1e3:.0f} ms, on {on * 1e3:.0f} ms: {off / on:.2f}x faster prefill")
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min; checkpoints in {export_dir.parent}")
