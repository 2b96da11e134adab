"""Measuring a distillation step: ours (layers < l once, the teacher's and the student's suffixes, the chunked KL)
against a whole teacher + a whole student forward on the same weights (the published trainer's structure): tokens/s,
peak tensor memory and model FLOPs (for MFU), on documents of real text packed into rows. ``benchmarks/gpu.py``
runs it at the public models' shapes, on a GPU or a CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from .batches import collate, pack, row_wise


def packed_batches(
    rows: int, row_tokens: int, segments: int, count: int, device: str, dataset: str = "brown_train"
) -> list[dict]:
    """``count`` batches of ``rows`` rows of ``row_tokens`` tokens, each row ``segments`` documents of real text
    (an offline data set's records joined, the default tokenizer), positions restarting per document: the recipes'
    packing."""
    from lightning.fabric.utilities import move_data_to_device
    from transformers import AutoTokenizer

    from swiftkv_core.default_model import default_model_path

    from .corpora import prepare

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    document, documents, need = [], [], rows * segments * count
    for line in prepare(dataset).open():
        document += tokenizer(json.loads(line)["text"] + "\n\n")["input_ids"]
        while len(document) >= row_tokens // segments and len(documents) < need:
            documents.append(document[: row_tokens // segments])
            document = document[row_tokens // segments :]
        if len(documents) >= need:
            break
    packed = pack(documents, row_tokens)
    return [
        move_data_to_device(collate(packed[i * rows : (i + 1) * rows], 0, row_tokens), device)
        for i in range(count)
    ]


def per_sequence(batch: dict) -> dict:
    """The packed ``batch`` with each of its sequences in a row of its own: the same model FLOPs as attention
    per packed sequence (what the MFU counts), whatever the attention implementation does with the packing."""
    starts = (batch["position_ids"] == 0).flatten().nonzero().flatten().tolist()
    lengths = {b - a for a, b in zip(starts, starts[1:] + [batch["position_ids"].numel()], strict=True)}
    if len(lengths) != 1:
        raise ValueError(f"per_sequence needs sequences of one length, got {sorted(lengths)}.")
    (length,) = lengths
    # without the collate's whole-batch entries: the step finds each row's from the rows
    return {k: v.reshape(-1, length) for k, v in row_wise(batch).items()}


WHOLE = "whole teacher + whole student"  # the published trainer's structure: two whole forwards, full logits


def step_rows(
    model,
    batches: list[dict],
    steps: int,
    warmup: int,
    peak_tflops: float | None,
    frozen: str,
    chunk_size: int,
    checkpointing: bool = False,
    compiled: bool = False,
    on_row: Callable[[dict], None] = lambda row: None,
) -> list[dict]:
    """Tokens/s, peak memory and MFU of a distillation step: ours and a whole teacher + a whole student forward on
    the same weights (``frozen``: their dtype), each with dense-mask sdpa and the device's packed attention, and
    compared with the whole of the same attention, checkpointing and compiling (the gain of ours alone, and its
    FLOPs bound: ``vs_whole``); a setup that runs out of device memory gives a row saying so (``out_of_memory``:
    the error's first line);
    ``checkpointing``: also both with activation checkpointing of every layer (``build.checkpoint_activations``);
    ``compiled``: then both with every decoder layer compiled (``build.compile_layers``, once; the last rows, as a
    compiled layer stays compiled). ``on_row``: told each row as it is measured (before the ratios: a run killed
    at its time limit keeps them)."""
    import torch.nn.functional as F

    from swiftkv_core.flops import count_flops

    from .build import attention_for, checkpoint_activations, compile_layers
    from .step import DistillationStep, LossSettings

    device, temperature = model.device, 2.0
    step = DistillationStep(model, LossSettings(temperature=temperature, chunk_size=chunk_size))

    def ours(batch):
        return step(batch, 1.0 / batch["loss_mask"].sum())["loss"]

    def whole(batch):  # the published trainer's structure: two whole forwards, full logits
        kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        mask = batch["loss_mask"]
        with torch.no_grad(), model.swiftkv_mode(False):
            teacher = model(**kwargs).logits[mask].float() / temperature
        student = model(**kwargs).logits[mask].float() / temperature
        return F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                        reduction="batchmean") * temperature**2  # fmt: skip

    packed = attention_for(device)  # sdpa on a CPU (PyTorch's flex_attention has no CPU backward)
    setups = [("ours, dense mask", ours, "sdpa", 0, False), (WHOLE, whole, "sdpa", 0, False)]
    if packed != "sdpa":  # both again, each packed sequence attending to itself alone
        setups += [("ours, packed", ours, packed, 0, False), (WHOLE, whole, packed, 0, False)]
    base = setups[-2:]  # ours and the whole with the fastest attention
    if checkpointing:  # both again, every layer recomputed
        setups += [(label, fn, attention, 1, False) for label, fn, attention, *_ in base]
    if compiled:  # both again, every layer compiled
        setups += [(label, fn, attention, 0, True) for label, fn, attention, *_ in base]
    trainable = [p for p in model.parameters() if p.requires_grad]
    rows, model_flops = [], {}
    for label, loss_fn, attention, every, compile_now in setups:
        variant = " + activation checkpointing" * every + " + compiled layers" * compile_now
        name = f"{label} ({attention}){variant}"
        model.config._attn_implementation = attention
        checkpoint_activations(model, every)
        compile_layers(model, compile_now)
        optimizer = torch.optim.AdamW(trainable, lr=1e-5)

        def one_step(batch, loss_fn=loss_fn, optimizer=optimizer):
            with torch.autocast(
                device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" or frozen != "fp32"
            ):
                loss = loss_fn(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # a setup that does not fit in the device's memory is a result too, and the next ones run
        try:
            seconds, peak_gib = _time_and_peak(one_step, batches, warmup, steps, model, optimizer)
        except torch.OutOfMemoryError as error:
            seconds, out_of_memory = None, str(error).splitlines()[0]
        if seconds is None:  # out of the except block, the error's frames and their tensors are gone
            rows.append({"setup": name, "frozen": frozen, "out_of_memory": out_of_memory})
            print(json.dumps(rows[-1]), flush=True)
            on_row(rows[-1])
            del optimizer, one_step  # its state (one_step holds the optimizer)
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        # FlopCounterMode sees no FLOPs inside a compiled flex_attention, nor in sdpa's GQA path: count eager's,
        # without the recomputed layers (the model's FLOPs: what MFU counts), its attention causal (as the bounds
        # count it), once per loss, a sequence at a time (their sum is the batch's; eager attention over a whole 8k
        # batch beside the whole teacher + student exceeds an 80 GB GPU)
        model.gradient_checkpointing_disable()
        model.config._attn_implementation = "eager"
        if loss_fn not in model_flops:
            sequences = per_sequence(batches[0])
            n_sequences, length = sequences["input_ids"].shape
            with torch.compiler.set_stance("force_eager"):
                model_flops[loss_fn] = sum(
                    count_flops(one_step, {k: v[i : i + 1] for k, v in sequences.items()}, causal_len=length)[0]
                    for i in range(n_sequences)
                )  # fmt: skip
        flops = model_flops[loss_fn]
        tokens = batches[0]["input_ids"].numel()
        rows.append({
            "setup": name, "frozen": frozen, "tokens_per_s": tokens / seconds, "step_s": seconds, "step_tflop": flops / 1e12,
            "peak_gib": peak_gib,
            "mfu": flops / seconds / (peak_tflops * 1e12) if peak_tflops else None,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        on_row(rows[-1])
        del optimizer
    model.config._attn_implementation = "sdpa"
    return vs_whole(rows)


def whole_like(setup: str) -> str:
    """The whole teacher + whole student setup of ``setup``'s attention, checkpointing and compiling (``step_rows``'
    names: ``LABEL (ATTENTION)VARIANT``)."""
    attention, variant = setup.split(" (", 1)[1].split(")", 1)
    return f"{WHOLE} ({attention}){variant}"


def vs_whole(rows: list[dict]) -> list[dict]:
    """``rows`` (``step_rows``') with their speed and memory over those of the whole like them (``whole_like``, with
    the same frozen weights' dtype), and the FLOPs bound of that speed-up: the whole's model FLOPs over the row's
    (ours runs layers < l once; the whole runs them in both forwards), the speed-up were both to run at the same
    FLOP rate (not a ceiling). None where either ran out of memory or no such whole was measured."""
    by_name = {(r["setup"], r["frozen"]): r for r in rows}

    def ratio(row: dict, key: str) -> float | None:
        whole = by_name.get((whole_like(row["setup"]), row["frozen"]), {})
        return row[key] / whole[key] if key in row and key in whole else None

    return [{**r, "speed_vs_whole_x": ratio(r, "tokens_per_s"), "memory_vs_whole_x": ratio(r, "peak_gib"),
             "flops_bound_x": 1 / flops if (flops := ratio(r, "step_tflop")) else None}
            for r in rows]  # fmt: skip


def _time_and_peak(
    one_step, batches: list[dict], warmup: int, steps: int, model, optimizer
) -> tuple[float, float]:
    """Seconds per step (after ``warmup`` steps, over ``steps``) and the peak tensor memory in GiB of one more step,
    untimed (a CPU's meter follows every tensor): weights, optimizer state, the step's activations, gradients and
    temporaries."""
    from swiftkv_core.runtime import PeakMemory, Stopwatch

    device = model.device
    for batch in batches[:warmup]:
        one_step(batch)
    watch = Stopwatch(device).start()
    for batch in batches[warmup : warmup + steps]:
        one_step(batch)
    seconds = watch.stop() / steps
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    with PeakMemory(device, resident=[*model.parameters(), *model.buffers(), *state]) as meter:
        one_step(batches[warmup + steps])
    return seconds, meter.peak_bytes / 2**30
