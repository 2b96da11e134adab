"""swiftkv_serve.bench's child process (one that fails) and swiftkv_serve.answers (a teacher's answers with vLLM, the
distillation's "vllm" answer backend), with the teacher-answers cache of swiftkv_distill.answers. Correctness only,
never timings. The whole serving comparison (both models, their ratios, the plot) runs in the main job's test,
tests/integration/test_quickstart.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import use_data_cache
from tests.serve.checkpoints import tiny_base

PROMPTS = ["What is rain?", "Name a colour.", "Say hello to the world."]


@pytest.mark.vllm
def test_generate_answers_reproducible_and_independent_of_batching(tiny_llama, capfd):
    """Seed per request: the same answers twice (in the child process and in-process), and a prompt's answer is
    the same whether it is batched with others or alone (at the same seed). The child's progress bar counts
    vLLM's two phases each from 0 (before, the answers' bar began with the prompts being added, then fell back),
    and ends on the answers, all of them."""
    from swiftkv_serve.answers import generate_answers, generate_in_process

    batched = generate_in_process(tiny_llama, PROMPTS, max_new_tokens=8, seed=5)
    assert len(batched) == len(PROMPTS) and all(isinstance(a, str) for a in batched)
    assert generate_in_process(tiny_llama, PROMPTS[1:2], max_new_tokens=8, seed=6) == batched[1:2]
    capfd.readouterr()
    assert generate_answers(tiny_llama, PROMPTS, max_new_tokens=8, seed=5, progress=True) == batched
    bar = capfd.readouterr().err
    states = [state.strip() for state in bar.split("\r") if state.startswith("teacher answers")]
    assert any(state.startswith("teacher answers (vLLM): rendering prompts: 100%") for state in states), (
        states
    )
    assert states[-1].startswith("teacher answers (vLLM): 100%") and " 3/3 " in states[-1], states


@pytest.mark.vllm
def test_teacher_answers_cache_is_reused_and_keyed_by_model(tmp_path, monkeypatch, tiny_llama):
    """A second call reads the cache (no generation); another model, backend or setting gets its own file, and the
    metadata beside each file says what it holds. vLLM answers each, counted, in this process (the child the
    backend starts is the test above's: four more of them would test only what it does)."""
    import swiftkv_serve.answers
    from swiftkv_distill import answers

    use_data_cache(monkeypatch, tmp_path / "data")
    calls = []

    def counted(model, prompts, max_new_tokens, temperature, top_p, seed):
        calls.append((str(model), max_new_tokens))
        return swiftkv_serve.answers.generate_in_process(
            model, prompts, max_new_tokens, temperature, top_p, seed
        )

    monkeypatch.setattr(swiftkv_serve.answers, "generate_answers", counted)
    other = tiny_base(tmp_path / "other-llama", seed=3)
    records = [{"prompt": p, "source": "t"} for p in PROMPTS] + [{"x": 1}, {"prompt": " "}]

    first = answers.teacher_answers(records, str(tiny_llama), max_new_tokens=8, backend="vllm")
    assert [r["prompt"] for r in first] == PROMPTS and first[0]["source"] == "t"
    assert answers.teacher_answers(records, str(tiny_llama), max_new_tokens=8, backend="vllm") == first
    assert len(calls) == 1  # the second call read the cache

    theirs = answers.teacher_answers(records, str(other), max_new_tokens=8, backend="vllm")
    assert len(calls) == 2 and calls[1][0] == str(other) and theirs != first
    answers.teacher_answers(records, str(tiny_llama), max_new_tokens=9, backend="vllm")
    assert len(calls) == 3
    answers.teacher_answers(records, str(tiny_llama), max_new_tokens=8, backend="vllm", cache=False)
    assert len(calls) == 4

    files = sorted((tmp_path / "data" / "teacher_answers").glob("*.jsonl"))
    assert len(files) == 3  # llama@8, other@8, llama@9; cache=False wrote nothing
    metas = [json.loads(f.with_suffix(".meta.json").read_text()) for f in files]
    assert {m["model"]["path"] for m in metas} == {str(tiny_llama.resolve()), str(other.resolve())}
    assert all(m["backend"] == "vllm" and m["num_prompts"] == 3 and m["model"]["weight_files"] for m in metas)

    # The same folder with other weights (a changed config) is another teacher.
    entry, _ = answers.teacher_answers_cache_file(records, str(tiny_llama), 8, backend="vllm")
    changed = tmp_path / "changed"
    shutil.copytree(tiny_llama, changed)
    entry_copy, _ = answers.teacher_answers_cache_file(records, str(changed), 8, backend="vllm")
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    entry_changed, _ = answers.teacher_answers_cache_file(records, str(changed), 8, backend="vllm")
    assert len({entry, entry_copy, entry_changed}) == 3
    hf_entry, _ = answers.teacher_answers_cache_file(records, str(tiny_llama), 8, backend="hf")
    assert hf_entry != entry and "-hf-" in hf_entry.name


@pytest.mark.vllm
def test_failing_child_raises_with_its_errors(tmp_path, tiny_llama):
    """A model the engine cannot load (a config alone: no tokenizer, no weights): the child's error lines are
    raised, nothing hangs."""
    from swiftkv_serve.bench import run_in_child
    from swiftkv_serve.child import ChildProcessFailed

    broken = tmp_path / "no-weights"
    broken.mkdir()
    shutil.copy(tiny_llama / "config.json", broken / "config.json")
    with pytest.raises(ChildProcessFailed, match="benchmark of broken") as error:
        run_in_child(broken, "broken", {"8/2": (8, 2)}, 1, 1, False, kv_cache_gib=0.25, timeout_s=300)
    # the child's own exception, the first thing it could not load
    assert "failed (exit 1)" in str(error.value) and "Couldn't instantiate the backend tokenizer" in str(
        error.value
    )


def test_bad_settings_are_refused_before_a_child_starts(tmp_path):
    """Settings the engine would refuse only after its start (tens of seconds, minutes on a GPU) are refused here,
    before any child or engine: the paths below do not even exist."""
    from swiftkv_serve.answers import generate_answers
    from swiftkv_serve.comparison import compare_serving

    for settings, refusal in (
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"temperature": -1.0}, "temperature must be a number >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ):
        with pytest.raises(ValueError, match=refusal):
            generate_answers(tmp_path / "missing", PROMPTS, **settings)
    for workloads, requests in (({"rag": (512, 8)}, 0), ({"rag": (512, 0)}, 4)):
        with pytest.raises(ValueError, match="each must be >= 1"):
            compare_serving(
                tmp_path / "a", tmp_path / "b", workloads, requests, max_num_seqs=4, compile=False
            )


def test_checkpoints_the_comparisons_cannot_serve_are_refused_before_the_stock_run(
    tmp_path, tiny_llama, tiny_swiftkv, tiny_swiftkv_lora
):
    """A SwiftKV checkpoint vLLM cannot serve (adapters kept apart), or none at all, is refused before the stock
    model's child runs its whole benchmark (it was refused after); the feature comparison checks its workload names
    and counts too, paths given as strings."""
    from swiftkv_serve.comparison import compare_serving, write_serving_report
    from swiftkv_serve.features import compare_features

    for swiftkv, refusal in ((tiny_swiftkv_lora, "lora_rank"), (tiny_llama, "not a SwiftKV checkpoint")):
        with pytest.raises(ValueError, match=refusal):
            compare_serving(tiny_llama, swiftkv, {"8/2": (8, 2)}, 1, max_num_seqs=1, compile=False)
        with pytest.raises(ValueError, match=refusal):
            compare_features(str(tiny_llama), str(swiftkv), 1, 1, False)
    with pytest.raises(ValueError, match=r"workload_names \['chat'\] \(known: \["):
        compare_features(str(tiny_llama), str(tiny_swiftkv), 1, 1, False, workload_names=["chat"])
    with pytest.raises(ValueError, match="num_requests 0"):
        compare_features(str(tiny_llama), str(tiny_swiftkv), 0, 1, False)
    # the report of compare_serving's own results (benchmarks/serve.py adds the command it ran; a library call has none)
    results = json.loads((Path(__file__).parents[2] / "benchmarks/results/serve.json").read_text())
    del results["command"]
    write_serving_report(results, tmp_path / "serving")
    assert "(a library call: compare_serving)" in (tmp_path / "serving.md").read_text()


def test_a_prompt_longer_than_the_models_context_is_refused_before_the_engine(tiny_llama):
    """One prompt that, with its answer, exceeds the model's context: refused naming it, before any child or engine
    starts (vLLM refused the engine, so every answer of the run was lost, with a traceback)."""
    from swiftkv_serve.answers import generate_answers, generate_in_process

    prompts = ["Say hi.", "rain " * 1100, "Name a colour."]  # the tiny model's context: 1024 tokens
    for generate in (generate_answers, generate_in_process):
        with pytest.raises(ValueError, match=r"1 prompt\(s\) \(indices \[1\]; the longest 11\d\d tokens\) plus "
                                             r"max_new_tokens=8 exceed .*context of 1024 tokens"):  # fmt: skip
            generate(tiny_llama, prompts, max_new_tokens=8)


def test_a_model_shorter_than_the_rounded_length_is_served_within_its_context(tiny_swiftkv):
    """The comparison's default length rounds up to 256 tokens; a model whose context is shorter (128, as the main
    job serves such a model its 10:1 split, 116/12) is served at its context: vLLM refused the rounded length. (Both
    engines serving 116/12 at 128 tokens, and refusing 256, were run once: the note of 2026-12-07; the whole
    comparison runs in the main job's test.)"""
    from transformers import AutoConfig

    from swiftkv_serve.comparison import engines_max_model_len

    config = AutoConfig.from_pretrained(tiny_swiftkv)  # a context of 1024
    assert engines_max_model_len({"116/12": (116, 12)}, config) == 256
    assert engines_max_model_len({"600/200": (600, 200)}, config) == 1024  # 800 rounded up: within 1024
    config.max_position_embeddings = 128
    assert engines_max_model_len({"116/12": (116, 12)}, config) == 128
