"""Integration: the real pretrained SmolLM2-135M-Instruct (30 layers), converted at l=15."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

from swiftkv.cli import main
from swiftkv_core.atomic import atomic_directory, exclusive
from swiftkv_core.convert import convert, export_for_serving
from swiftkv_core.flops import ModelShape, count_flops, prefill_flops_total
from tests.processes import lines as output_lines

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def chat_batch(tokenizer, prompts):
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def swift(smollm2):
    base, _ = smollm2
    return convert(base, 15)


def test_default_model_is_the_real_pretrained_smollm2(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.input_ids.shape[1] :])


def test_a_process_finding_the_default_model_being_materialised_waits_and_takes_it(smollm2_path, tmp_path):
    """Two processes materialising the default model into an empty cache (the ranks of a `fabric run` on a fresh
    machine): the later one, a real process, waits for the first one's lock and takes its result, neither
    dequantising again nor deleting the first one's staging folder."""
    cache = tmp_path / "cache"
    target = cache / "models" / smollm2_path.name
    code = "from swiftkv_core.default_model import default_model_path; print('PATH', default_model_path())"
    env = {**os.environ, "SWIFTKV_CACHE_DIR": str(cache)}
    with exclusive(target):  # this process is the first one
        later = subprocess.Popen([sys.executable, "-c", code], env=env, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)  # fmt: skip
        lines = []
        for line in output_lines(later.stdout, timeout=120):  # until it says it waits (or ends)
            lines.append(line)
            if line.startswith("Waiting for another process materialising"):
                break
        assert lines and lines[-1].startswith("Waiting"), "".join(lines)
        with atomic_directory(target) as staging:  # the first one's result: the session's default model
            shutil.copytree(smollm2_path, staging, dirs_exist_ok=True)
    rest, _ = later.communicate(timeout=120)
    assert later.returncode == 0, "".join(lines) + rest
    assert f"PATH {target}\n" in rest and "Materialising" not in "".join(lines) + rest


@torch.no_grad()
def test_teacher_mode_equals_the_base_model(smollm2, swift):
    base, tokenizer = smollm2
    ids = tokenizer("SwiftKV skips the later layers for prompt tokens.", return_tensors="pt").input_ids
    assert_close(swift.swiftkv(False)(ids).logits, base(ids).logits)
    swift.swiftkv(True)


@torch.no_grad()
def test_swiftkv_generate_equals_the_full_forward(smollm2, swift):
    _, tokenizer = smollm2
    batch = chat_batch(tokenizer, PROMPTS)
    generated = swift.generate(
        **batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    for i, prompt in enumerate(PROMPTS):  # each alone, token by token with no cache: every layer, every token
        ids = chat_batch(tokenizer, [prompt]).input_ids
        for _ in range(12):
            ids = torch.cat([ids, swift(ids, use_cache=False).logits[:, -1:].argmax(-1)], 1)
        width = batch.input_ids.shape[1]
        n = ids.shape[1] - 12
        assert torch.equal(generated[i, width:], ids[0, n:]), prompt
    # and the last-position logits of a cached prefill match the full forward
    ids = batch.input_ids[-1:]
    assert_close(
        swift(ids, use_cache=True, logits_to_keep=1).logits[:, -1],
        swift(ids).logits[:, -1],
        atol=1e-4,
        rtol=1e-4,
    )


@torch.no_grad()
def test_measured_prefill_flops_match_the_analytic_model(swift, smollm2):
    _, tokenizer = smollm2
    ids = tokenizer("word " * 300, return_tensors="pt").input_ids
    shape = ModelShape.from_config(swift.config)
    for l in (None, 15):
        model = swift.swiftkv(l is not None)
        measured, _ = count_flops(model, ids, use_cache=True, logits_to_keep=1)
        assert measured == pytest.approx(
            prefill_flops_total(shape, ids.shape[1], l, attention="dense"), rel=1e-9
        )
    swift.swiftkv(True)


def test_serving_export_is_smaller_and_generates_the_same(swift, smollm2, tmp_path):
    from transformers import AutoModelForCausalLM

    _, tokenizer = smollm2
    export_for_serving(swift, tmp_path, tokenizer=tokenizer)
    served = AutoModelForCausalLM.from_pretrained(tmp_path)
    batch = chat_batch(tokenizer, PROMPTS[:1])
    kwargs = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(served.generate(**batch, **kwargs), swift.generate(**batch, **kwargs))
    full = sum(p.numel() for p in swift.parameters())
    assert sum(p.numel() for p in served.parameters()) < full


def test_cli_generate_and_analyze(tmp_path, capsys):
    main(["generate", "--prompt", "What is the capital of France?", "--max_new_tokens", "8"])
    out = capsys.readouterr().out
    assert "Paris" in out and "prefill" in out
    main(["generate", "--num_key_value_layers", "15", "--max_new_tokens", "4"])
    assert "SwiftKV l=15/30" in capsys.readouterr().out
    main(["analyze", "--out_dir", str(tmp_path), "--max_length", "64"])
    assert (tmp_path / "similarity.png").is_file()
    report = json.loads((tmp_path / "similarity.json").read_text())
    similarity, l = report["similarity"], report["recommended_num_key_value_layers"]
    assert report["num_hidden_layers"] == 30 and len(similarity) == 29  # layer j's input vs layer j + 1's
    assert all(-1 <= s <= 1 for s in similarity)
    # the recommendation: the first l >= 1 whose input is as similar as the threshold (0.9, the paper's) asks
    assert l == next(j for j, s in enumerate(similarity) if j >= 1 and s >= report["threshold"] == 0.9)
