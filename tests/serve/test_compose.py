"""SwiftKV composed with vLLM's n-gram speculative decoding, automatic prefix caching, chunked prefill and
preemption: greedy outputs equal to plain SwiftKV decoding, and the engine's own counters show that each feature
really did something (drafts accepted, prefix-cache hits mid-prompt, preemptions), or equality would prove nothing.

The speculative engines run in child processes: vLLM 0.32's CPU kernel-override scan at every engine start
(``triton_utils/dispatcher.py``, ``_rebind_kernels``) reads ``vars()`` of every module attribute and crashes on
llvmlite's ``ffi.lib`` (its ``__getattr__`` answers ``__dict__`` too), which the n-gram proposer imports with numba.
So no engine can start in a process after an n-gram engine; the child hides that module while its own engines
start, and the test process never imports numba.
"""

from __future__ import annotations

import contextlib
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest

from tests.serve.checkpoints import swiftkv_checkpoint
from tests.serve.conftest import greedy, random_prompts, vllm_engine

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


def run_features(jobs: dict[str, tuple[str, list[list[int]]]]) -> dict[str, dict[str, list[dict]]]:
    """In the child process: each model's feature sets (``FEATURES_OF``), two passes with prefix caching."""
    results: dict[str, dict[str, list[dict]]] = {}
    for name, (path, prompts) in jobs.items():
        results[name] = {}
        for feature in FEATURES_OF[name]:
            options = FEATURES[feature]
            with engine(path, **options) as llm:
                passes = 2 if options.get("enable_prefix_caching") else 1
                results[name][feature] = runs(llm, prompts, passes)
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
        return pool.submit(run_features, jobs).result()


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


# --- KV-cache pressure: preemption and recomputation (in this process: no n-gram engine) ---
@pytest.fixture(scope="module")
def pressure_runs(tiny_swiftkv):
    """The same requests unpressured and with 8 KV blocks of 128 tokens: 8 prompts of 110 tokens fill them,
    and each needs a second block after 18 output tokens, so running requests are preempted and recomputed."""
    prompts = random_prompts(lengths=(110,) * 8, seed=13)
    results = {}
    for name, options in {"unpressured": {}, "pressured": {"num_gpu_blocks_override": 8}}.items():
        with engine(tiny_swiftkv, enable_prefix_caching=True, **options) as llm:
            results[name] = runs(llm, prompts, 1, max_tokens=60)[0]
    return results


def test_preemption_under_kv_pressure_keeps_outputs_and_frees_blocks(pressure_runs):
    unpressured, pressured = pressure_runs["unpressured"], pressure_runs["pressured"]
    assert unpressured["vllm:num_preemptions"] == 0
    assert pressured["vllm:num_preemptions"] > 0
    assert pressured["tokens"] == unpressured["tokens"]
    assert pressured["kv_cache_usage"] == unpressured["kv_cache_usage"] == 0


# --- all at once: preemption under KV pressure with n-gram speculation and prefix caching (child process) ---
def pressure_prompts(seed: int) -> list[list[int]]:
    """8 prompts: one shared 128-token block (prefix-cache hits), then 100 tokens of a pattern of their own,
    repeated (continuations the n-gram proposer finds in the prompt). In 8 KV blocks of 128 tokens, the shared
    block and 7 second blocks fill the cache; each request needs a third block after 28 output tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 49000) for _ in range(128)]
    return [shared + [rng.randrange(100, 49000) for _ in range(10)] * 10 for _ in range(8)]


def run_pressure_with_features(path: str, prompts: list[list[int]], max_tokens: int) -> dict[str, dict]:
    """In the child process: plain SwiftKV decoding, then n-gram + prefix caching in 8 KV blocks, the latter
    also read the serving benchmark's way (``swiftkv_serve.bench.engine_counters``, ``spec_decode_stats``)."""
    from swiftkv_serve.bench import engine_counters, spec_decode_stats

    results = {}
    with engine(path) as llm:
        results["plain"] = runs(llm, prompts, 1, max_tokens)[0]
    options = {"enable_prefix_caching": True, "speculative_config": SPECULATION, "num_gpu_blocks_override": 8}
    with engine(path, **options) as llm:
        before = engine_counters()
        results["pressured"] = run = runs(llm, prompts, 1, max_tokens)[0]
        burst = {"num_requests": len(prompts), "output_tokens": sum(map(len, run["tokens"]))}
        run["spec_decode"] = spec_decode_stats(before, engine_counters(), burst)
    return results


@pytest.fixture(scope="module")
def pressure_feature_runs(tiny_swiftkv):
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(
            run_pressure_with_features, str(tiny_swiftkv), pressure_prompts(seed=14), 60
        ).result()


def test_preemption_with_ngram_and_prefix_caching_keeps_outputs_and_frees_blocks(pressure_feature_runs):
    plain, pressured = pressure_feature_runs["plain"], pressure_feature_runs["pressured"]
    assert pressured["tokens"] == plain["tokens"]
    assert plain["vllm:num_preemptions"] == 0 < pressured["vllm:num_preemptions"]
    assert pressured["vllm:spec_decode_num_accepted_tokens"] > 0
    assert pressured["vllm:prefix_cache_hits"] > 0
    assert pressured["kv_cache_usage"] == plain["kv_cache_usage"] == 0
    # The benchmark's reading of the same engine: the same counters, fewer decode steps than decode tokens.
    spec = pressured["spec_decode"]
    assert spec["draft_tokens"] == pressured["vllm:spec_decode_num_draft_tokens"]
    assert spec["accepted_tokens"] == pressured["vllm:spec_decode_num_accepted_tokens"]
    assert spec["engine_steps"] > 0
    assert spec["tokens_per_step"] > 1
