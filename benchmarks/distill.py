"""Training throughput and peak memory: our distillation step vs a naive two-copy teacher/student setup.

Same model, same batches, same optimizer, one process each (so each peak RSS is its own):

- ``ours``: one copy of the weights; embeddings + layers < l run once without autograd and are shared by the
  teacher and student passes; full-vocabulary logits only in chunks (swiftkv_distill.DistillationStep).
- ``naive``: what a straightforward trainer does (the published one's structure): a separate frozen teacher model
  (the original HF model) and a SwiftKV student, each running its whole forward; full logits for the KL.

    .venv/bin/python benchmarks/distill.py            # SmolLM2-135M-Instruct at l=15, 4 x 256 tokens per step
Writes benchmarks/results/distill-bench.{json,md}.
"""

from __future__ import annotations

import json
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

RESULTS = Path(__file__).parent / "results"


def _batches(tokenizer, steps: int, batch_size: int, seq_len: int):
    from swiftkv_distill.batches import collate, pack
    from swiftkv_distill.corpora import prepare
    from swiftkv_distill.data import encode_record

    records = [json.loads(line) for line in prepare("brown_train").open()][:4000]
    rows = pack([encode_record(r, tokenizer)[0] for r in records], seq_len)
    return [collate(rows[i * batch_size : (i + 1) * batch_size], 0, seq_len) for i in range(steps)]


def run_one(setup: str, steps: int, warmup: int, batch_size: int, seq_len: int, l: int) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftkv_core.convert import convert
    from swiftkv_core.default_model import default_model_path

    torch.manual_seed(0)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = _batches(tokenizer, steps + warmup, batch_size, seq_len)
    temperature = 2.0
    if setup == "ours":
        from swiftkv_distill import DistillationStep, LossSettings

        step = DistillationStep(
            convert(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), l),
            LossSettings(temperature=temperature, chunk_size=512),
        )
        params = [p for p in step.parameters() if p.requires_grad]

        def loss_fn(batch):
            return step(batch, 1.0 / batch["loss_mask"].sum())["loss"]
    elif setup == "prefix_twice":
        # ours (one copy, chunked loss) but layers < l run in both passes, as the published trainer does
        from swiftkv_distill.loss import distillation_kl

        model = convert(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), l)
        params = [p for p in model.parameters() if p.requires_grad]
        inner = model.model

        def loss_fn(batch):
            mask = batch["loss_mask"]
            kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            with torch.no_grad():
                hidden, context = inner.forward_prefix(**kwargs)
                teacher = inner.norm(inner.forward_suffix(hidden, context, swiftkv=False))[mask]
            hidden, context = inner.forward_prefix(**kwargs)
            student = inner.norm(inner.forward_suffix(hidden, context, swiftkv=True))[mask]
            rows = torch.full((student.shape[0],), 1.0 / student.shape[0])
            return distillation_kl(student, teacher, model.lm_head.weight, rows, temperature, 512)[0]
    else:
        teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        student = convert(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), l).train()
        params = [p for p in student.parameters() if p.requires_grad]

        def loss_fn(batch):
            kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            mask = batch["loss_mask"]
            with torch.no_grad():
                t_logits = teacher(**kwargs).logits[mask] / temperature
            s_logits = student(**kwargs).logits[mask] / temperature
            return (
                F.kl_div(
                    F.log_softmax(s_logits, -1),
                    F.log_softmax(t_logits, -1),
                    log_target=True,
                    reduction="batchmean",
                )
                * temperature**2
            )

    optimizer = torch.optim.AdamW(params, lr=1e-4)
    losses, start = [], None
    for i, batch in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        loss = loss_fn(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    seconds = time.perf_counter() - start
    tokens = steps * batch_size * seq_len
    return {
        "setup": setup,
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "tokens": tokens,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": losses,
    }


def main(
    steps: int = 6,
    warmup: int = 1,
    batch_size: int = 4,
    seq_len: int = 256,
    num_key_value_layers: int = 15,
    rounds: int = 2,
    one: Literal["ours", "prefix_twice", "naive"] | None = None,
) -> None:
    """Time the three setups in separate processes, alternating, best round of each; write the results.

    Args:
        steps: timed training steps per setup.
        warmup: untimed steps before them.
        batch_size: rows per step.
        seq_len: tokens per row.
        num_key_value_layers: l of the SwiftKV model.
        rounds: alternating rounds over the setups (the best of each counts).
        one: run only this setup in this process and print its result as JSON (used by the rounds).
    """
    shape = (steps, warmup, batch_size, seq_len, num_key_value_layers)
    if one:
        print(json.dumps(run_one(one, *shape)))
        return
    results = {}
    # Separate processes: separate peak memory. Rounds alternate the setups and the best round of each counts, so
    # a neighbour's load on this shared machine hits all setups alike rather than one.
    for setup in [s for _ in range(rounds) for s in ("ours", "prefix_twice", "naive")]:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                setup,
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
                "--batch_size",
                str(batch_size),
                "--seq_len",
                str(seq_len),
                "--num_key_value_layers",
                str(num_key_value_layers),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if setup not in results or result["tokens_per_s"] > results[setup]["tokens_per_s"]:
            results[setup] = result
        print(f"{setup}: {result['tokens_per_s']:.1f} tokens/s, peak RSS {result['peak_rss_gib']:.2f} GiB")
    ours, naive, twice = results["ours"], results["naive"], results["prefix_twice"]
    summary = {
        "model": "SmolLM2-135M-Instruct",
        "num_key_value_layers": num_key_value_layers,
        "batch": f"{batch_size} x {seq_len} tokens",
        "steps_timed": steps,
        "speedup_tokens_per_s": ours["tokens_per_s"] / naive["tokens_per_s"],
        "peak_memory_ratio_ours_over_naive": ours["peak_rss_gib"] / naive["peak_rss_gib"],
        "prefix_once_speedup": ours["tokens_per_s"] / twice["tokens_per_s"],
        "first_loss_equal": abs(ours["losses"][0] - naive["losses"][0])
        < 1e-3 * max(1.0, abs(naive["losses"][0])),
        "ours": ours,
        "prefix_twice": twice,
        "naive": naive,
        "command": shlex.join([".venv/bin/python", "benchmarks/distill.py", *sys.argv[1:]]),
    }
    print(f"layers < l once instead of twice: {summary['prefix_once_speedup']:.2f}x tokens/s")
    print(
        f"speed-up {summary['speedup_tokens_per_s']:.2f}x tokens/s; peak memory ours/naive "
        f"{summary['peak_memory_ratio_ours_over_naive']:.2f}; same first loss: {summary['first_loss_equal']}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distill-bench.json").write_text(json.dumps(summary, indent=2))
    (RESULTS / "distill-bench.md").write_text(
        "# Distillation step: ours vs naive two-copy teacher/student\n\n"
        f"SmolLM2-135M-Instruct, l={num_key_value_layers}, {summary['batch']} per step, {steps} timed steps "
        f"after {warmup} warm-up, fp32, 2-core CPU (shared), one process per setup and round, best of "
        f"{rounds} alternating rounds.\n\n"
        "| setup | tokens/s | peak RSS (GiB) |\n|---|---|---|\n"
        f"| ours (one copy, layers < l once, chunked logits) | {ours['tokens_per_s']:.1f} | {ours['peak_rss_gib']:.2f} |\n"
        f"| ours, but layers < l run in both passes | {twice['tokens_per_s']:.1f} | {twice['peak_rss_gib']:.2f} |\n"
        f"| naive (teacher + student copies, full logits) | {naive['tokens_per_s']:.1f} | {naive['peak_rss_gib']:.2f} |\n"
        f"| **ratio** | **{summary['speedup_tokens_per_s']:.2f}x** | **{summary['peak_memory_ratio_ours_over_naive']:.2f}x** |\n\n"
        f"Running layers < l once instead of twice, alone: {summary['prefix_once_speedup']:.2f}x tokens/s.\n\n"
        f"Same loss on the first batch: {summary['first_loss_equal']} "
        f"({ours['losses'][0]:.5f} vs {naive['losses'][0]:.5f}).\n\nCommand: `{summary['command']}`\n"
    )


if __name__ == "__main__":
    from jsonargparse import auto_cli

    auto_cli(main, as_positional=False)
