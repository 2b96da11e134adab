"""SwiftKV composed with vLLM's n-gram speculative decoding, automatic prefix caching, chunked prefill and
preemption: greedy outputs equal to plain SwiftKV decoding, and the engine's own counters show that each feature
really did something (drafts accepted, prefix-cache hits mid-prompt, preemptions), or equality would prove nothing.

The engines run in one child process: vLLM 0.32's CPU kernel-override scan at every engine start
(``triton_utils/dispatcher.py``, ``_rebind_kernels``) reads ``vars()`` of every module attribute and crashes on
llvmlite's ``ffi.lib`` (its ``__getattr__`` answers ``__dict__`` too), which the n-gram proposer imports with numba.
So no engine can start in a process after an n-gram engine; the child hides that module while its engines start,
and the test process never imports numba.
"""

from __future__ import annotations

import contextlib
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest

from tests.serve.checkpoints import swiftkv_checkpoint
from tests.serve.conftest import greedy, vllm_engine

pytestmark = pytest.mark.vllm

MAX_TOKENS = 32
SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
FEATURES = {
    "plain": {},
    "prefix-caching": {"enable_prefix_caching": True},
    "ngram": {"speculative_config": SPECULATION},
    "ngram+prefix-caching": {"enable_prefix_caching": True, "speculative_config": SPECULATION},
}
# Each feature alone on the tiny Llama; the other families and the real model with both at once (an engine start
# is most of each case's cost)
FEATURES_OF = {
    "llama-l4-g2": tuple(FEATURES),
    "qwen2-l6-g2": ("plain", "ngram+prefix-caching"),
    "smollm2-l24-g2": ("plain", "ngram+prefix-caching"),
}
MODELS = tuple(FEATURES_OF)
# KV-cache pressure on the tiny Llama (pressure_prompts): 8 KV blocks of 128 tokens, with prefix caching alone and
# with n-gram speculation too; the unpressured reference is its plain engine
PRESSURED, PRESSURE_TOKENS = "llama-l4-g2", 60
PRESSURE = {
    feature: {**FEATURES[feature], "num_gpu_blocks_override": 8}
    for feature in ("prefix-caching", "ngram+prefix-caching")
}
COUNTERS = (
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
)


def counters(llm) -> dict[str, float]:
    """The engine's Prometheus counters we check (summed over label sets) and its KV cache usage now."""
    values = dict.fromkeys(COUNTERS, 0.0)
    usage = []
    for metric in llm.get_metrics():
        if metric.name in values:
            values[metric.name] += metric.value
        elif metric.name == "vllm:kv_cache_usage_perc":
            usage.append(metric.value)
    values["kv_cache_usage"] = max(usage)
    return values


def runs(llm, prompts: list[list[int]], passes: int, max_tokens: int = MAX_TOKENS) -> list[dict]:
    """``passes`` greedy passes over ``prompts``: tokens, counter increments, KV usage once idle."""
    results = []
    for _ in range(passes):
        before = counters(llm)
        tokens = greedy(llm, prompts, max_tokens)
        after = counters(llm)
        delta = {name: after[name] - before[name] for name in COUNTERS}
        results.append({"tokens": tokens, **delta, "kv_cache_usage": after["kv_cache_usage"]})
    return results


@contextlib.contextmanager
def engine(path, **options):
    """``vllm_engine`` with stats on, started while llvmlite's ffi module is out of ``sys.modules`` (see above)."""
    with contextlib.ExitStack() as stack:
        hidden = sys.modules.pop("llvmlite.binding.ffi", None)
        try:
            llm = stack.enter_context(
                vllm_engine(path, disable_log_stats=False, **{"enable_prefix_caching": False, **options})
            )
        finally:
            if hidden is not None:
                sys.modules["llvmlite.binding.ffi"] = hidden
        yield llm


def run_all(jobs: dict[str, tuple[str, list[list[int]]]], pressure: list[list[int]]) -> dict[str, dict]:
    """In the child process: each model's feature sets (``FEATURES_OF``), two passes with prefix caching; then the
    tiny Llama's ``pressure`` prompts, unpressured on its plain engine and in 8 KV blocks with each ``PRESSURE``
    feature set, the latter with n-gram also read the serving benchmark's way (``swiftkv_serve.bench``)."""
    from swiftkv_serve.bench import engine_counters, spec_decode_stats

    results: dict[str, dict] = {"pressure": {}}
    for name, (path, prompts) in jobs.items():
        results[name] = {}
        for feature in FEATURES_OF[name]:
            options = FEATURES[feature]
            with engine(path, **options) as llm:
                passes = 2 if options.get("enable_prefix_caching") else 1
                results[name][feature] = runs(llm, prompts, passes)
                if name == PRESSURED and feature == "plain":
                    results["pressure"]["plain"] = runs(llm, pressure, 1, PRESSURE_TOKENS)[0]
    for feature, options in PRESSURE.items():
        with engine(jobs[PRESSURED][0], **options) as llm:
            before = engine_counters()
            results["pressure"][feature] = run = runs(llm, pressure, 1, PRESSURE_TOKENS)[0]
            if "speculative_config" in options:
                burst = {"num_requests": len(pressure), "output_tokens": sum(map(len, run["tokens"]))}
                run["spec_decode"] = spec_decode_stats(before, engine_counters(), burst)
    return results


def tiny_prompts(seed: int) -> list[list[int]]:
    """Three prompts sharing a 300-token prefix (cache hits end mid-prompt: two 128-token blocks, then chunks of
    48), and two repetitive ones whose continuations the n-gram proposer can find in the prompt."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    shared = tokens(300)
    pattern = tokens(7)
    return [shared + tokens(n) for n in (5, 40, 90)] + [pattern * 12, tokens(20) + pattern[:3] * 20]


def smollm2_prompts(path) -> list[list[int]]:
    """A shared document, then instructions whose answers copy spans of it (what n-gram speculation is for)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    document = (
        "Shipping log, Tuesday. Crate 17 (ceramic tiles, 40 kg) left Rotterdam at 06:10 on the barge Alma. "
        "Crate 18 (copper wire, 25 kg) left Antwerp at 07:45 on the truck Bravo-2. Crate 19 (oak planks, 90 kg) "
        "left Hamburg at 09:30 on the train Nordic Express. Crate 20 (glass jars, 15 kg) left Rotterdam at 11:05 "
        "on the barge Alma. Crate 21 (steel bolts, 60 kg) left Antwerp at 13:20 on the truck Bravo-2. "
    ) * 2
    questions = [
        "Repeat the line about crate 19 word for word:",
        "Copy the sentence about crate 21 exactly:",
        "List every crate that left Rotterdam, with its cargo and time:",
        "Repeat the whole log above:",
    ]
    return [tokenizer(document + "\n" + question + "\n")["input_ids"] for question in questions]


@pytest.fixture(scope="module")
def feature_runs(tiny_swiftkv, tiny_qwen2_swiftkv, smollm2, checkpoints):
    smollm2_swiftkv = swiftkv_checkpoint(smollm2, checkpoints / "smollm2-compose-l24-g2", 24, 2)
    jobs = {
        "llama-l4-g2": (str(tiny_swiftkv), tiny_prompts(seed=11)),
        "qwen2-l6-g2": (str(tiny_qwen2_swiftkv), tiny_prompts(seed=12)),
        "smollm2-l24-g2": (str(smollm2_swiftkv), smollm2_prompts(smollm2_swiftkv)),
    }
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(run_all, jobs, pressure_prompts(seed=14)).result()


@pytest.mark.parametrize(
    ("model", "feature"),
    [
        (model, feature)
        for model, features in FEATURES_OF.items()
        for feature in features
        if feature != "plain"
    ],
)
def test_greedy_outputs_equal_plain_decoding(feature_runs, model, feature):
    plain = feature_runs[model]["plain"][0]["tokens"]
    for run in feature_runs[model][feature]:
        assert run["tokens"] == plain


@pytest.mark.parametrize("model", MODELS)
def test_each_feature_was_exercised(feature_runs, model):
    features = feature_runs[model]
    for feature in {"ngram", "ngram+prefix-caching"} & features.keys():
        for run in features[feature]:
            assert run["vllm:spec_decode_num_draft_tokens"] > 0, feature
            assert run["vllm:spec_decode_num_accepted_tokens"] > 0, feature
    for feature in {"prefix-caching", "ngram+prefix-caching"} & features.keys():
        first, second = features[feature]
        # First pass: later prompts reuse the shared document's blocks; second pass: every full block.
        assert 0 < first["vllm:prefix_cache_hits"] < second["vllm:prefix_cache_hits"], feature
    for feature in {"plain", "ngram"} & features.keys():
        assert all(run["vllm:prefix_cache_hits"] == 0 for run in features[feature])
    for run in (run for feature in features.values() for run in feature):
        assert run["kv_cache_usage"] == 0  # every block released once the engine is idle


# --- KV-cache pressure: preemption and recomputation, alone and with n-gram speculation and prefix caching ---
def pressure_prompts(seed: int) -> list[list[int]]:
    """8 prompts: one shared 128-token block (prefix-cache hits), then 100 tokens of a pattern of their own,
    repeated (continuations the n-gram proposer finds in the prompt). In 8 KV blocks of 128 tokens, the shared
    block and 7 second blocks fill the cache; each request needs a third block after 28 output tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 49000) for _ in range(128)]
    return [shared + [rng.randrange(100, 49000) for _ in range(10)] * 10 for _ in range(8)]


@pytest.mark.parametrize("feature", PRESSURE)
def test_preemption_under_kv_pressure_keeps_outputs_and_frees_blocks(feature_runs, feature):
    plain, pressured = feature_runs["pressure"]["plain"], feature_runs["pressure"][feature]
    assert pressured["tokens"] == plain["tokens"]
    assert plain["vllm:num_preemptions"] == 0 < pressured["vllm:num_preemptions"]
    assert pressured["vllm:prefix_cache_hits"] > 0
    assert pressured["kv_cache_usage"] == plain["kv_cache_usage"] == 0


def test_the_benchmarks_reading_of_speculation_under_kv_pressure(feature_runs):
    """The serving benchmark's reading of the pressured n-gram engine: the same counters, fewer decode steps than
    decode tokens."""
    pressured = feature_runs["pressure"]["ngram+prefix-caching"]
    assert pressured["vllm:spec_decode_num_accepted_tokens"] > 0
    spec = pressured["spec_decode"]
    assert spec["draft_tokens"] == pressured["vllm:spec_decode_num_draft_tokens"]
    assert spec["accepted_tokens"] == pressured["vllm:spec_decode_num_accepted_tokens"]
    assert spec["engine_steps"] > 0
    assert spec["tokens_per_step"] > 1
