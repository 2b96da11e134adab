"""SwiftKV through vLLM's offline engine (``vllm.LLM``): outputs, prefill savings, KV capacity, guards."""

from __future__ import annotations

import contextlib
import io
import logging
import re

import pytest
import torch

from tests.serve.checkpoints import hf_greedy, swiftkv_checkpoint
from tests.serve.conftest import PROMPT_LENGTHS, greedy, random_prompts, vllm_engine, without_weights

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12


@contextlib.contextmanager
def vllm_log():
    """What the handlers of vLLM's logger print meanwhile (its own: its format, its level)."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    configure_logging_if_needed(LoggingConfig())  # as an engine's config does first: a no-op there then
    handlers = [h for h in logging.getLogger("vllm").handlers if isinstance(h, logging.StreamHandler)]
    assert any(h.name == "vllm" for h in handlers)  # vLLM's own, as its dictConfig names it
    log = io.StringIO()
    streams = [h.setStream(log) for h in handlers]
    try:
        yield log
    finally:
        for handler, stream in zip(handlers, streams, strict=True):
            handler.setStream(stream)


@pytest.fixture(scope="module")
def tiny_engine(tiny_swiftkv):
    with vllm_engine(tiny_swiftkv) as llm:
        yield llm


def test_tiny_acrosskv_matches_hf(tiny_engine, tiny_swiftkv):
    """A batch of prompts of different lengths, chunked prefill splitting them (chunks of 48 tokens)."""
    prompts = random_prompts()
    assert max(PROMPT_LENGTHS) > 2 * 48
    assert greedy(tiny_engine, prompts, MAX_TOKENS) == hf_greedy(tiny_swiftkv, prompts, MAX_TOKENS)
    assert tiny_engine.llm_engine.vllm_config.cache_config.kv_sharing_fast_prefill


def test_later_layers_run_only_for_sampled_tokens(tiny_engine):
    """Layers >= l see one token per prompt chunk (the one whose logits are sampled); layer 0 sees them all."""
    seen: dict[str, list[int]] = {"first": [], "swiftkv": [], "last": []}

    def install(model):
        layers = model.model.layers
        l = model.config.num_key_value_layers
        return [
            layers[i].register_forward_hook(lambda m, args, out, key=key: seen[key].append(args[1].shape[0]))
            for i, key in ((0, "first"), (l, "swiftkv"), (len(layers) - 1, "last"))
        ]

    handles = tiny_engine.apply_model(install)[0]
    try:
        greedy(tiny_engine, random_prompts(lengths=(130,), seed=5), 3)
    finally:
        for handle in handles:
            handle.remove()
    # 130 prompt tokens in chunks of 48, 48, 34, then 2 decode steps (the third token is sampled from the last).
    assert seen["first"] == [48, 48, 34, 1, 1]
    assert seen["swiftkv"] == seen["last"] == [1, 1, 1, 1, 1]


def test_prompt_logprobs_rejected(tiny_engine):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=random_prompts(lengths=(20,))[0])
    with pytest.raises(VLLMValidationError, match="prompt_logprobs are not supported by SwiftKV"):
        tiny_engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    # The engine keeps serving, and sampled-token logprobs are fine.
    out = tiny_engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=2, logprobs=2), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2 and out[0].outputs[0].logprobs


def test_fast_prefill_off_serves_prompt_logprobs_of_the_swiftkv_model(tiny_swiftkv):
    """``swiftkv_fast_prefill: false``: every layer runs for every prompt token, the greedy outputs are the SwiftKV
    model's (HF's, as with fast prefill), and prompt logprobs are served: its own, as its HF forward has them. The
    plugin says so in vLLM's log, through vLLM's own handler and format."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from swiftkv_core.generation import load

    prompts = random_prompts()
    with (
        vllm_log() as log,
        vllm_engine(tiny_swiftkv, additional_config={"swiftkv_fast_prefill": False}) as llm,
    ):
        line = r"INFO .*\[engine_config.py:\d+\] SwiftKV: fast prefill off \(swiftkv_fast_prefill=false\)"
        assert re.search(line, log.getvalue())
        assert not llm.llm_engine.vllm_config.cache_config.kv_sharing_fast_prefill
        tokens = greedy(llm, prompts, MAX_TOKENS)
        scored = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
    assert tokens == hf_greedy(tiny_swiftkv, prompts, MAX_TOKENS)
    model, _ = load(tiny_swiftkv, dtype=torch.float32)
    for prompt, out in zip(prompts, scored, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        served = torch.tensor([out.prompt_logprobs[i][token].logprob for i, token in enumerate(prompt) if i])
        torch.testing.assert_close(served, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("additional_config", "message"),
    [
        ({"swiftkv_fast_prefill": "no"}, "swiftkv_fast_prefill='no': use true"),
        ({"swiftkv_fastprefill": False}, "unknown SwiftKV option"),
    ],
)
def test_bad_fast_prefill_option_is_refused_before_loading(
    tiny_swiftkv, tmp_path, additional_config, message
):
    """A checkpoint without its weights: the option's error, not the weights' (read later, so never reached)."""
    with (
        pytest.raises(ValueError, match=re.escape(message)),
        vllm_engine(without_weights(tiny_swiftkv, tmp_path), additional_config=additional_config),
    ):
        pass


def test_serving_export_matches_hf(tiny_swiftkv_serving):
    """A checkpoint without the teacher q/k/v of layers >= l (export_for_serving), AcrossKV off."""
    prompts = random_prompts(seed=3)
    with vllm_engine(tiny_swiftkv_serving) as llm:
        got = greedy(llm, prompts, MAX_TOKENS)
    assert got == hf_greedy(tiny_swiftkv_serving, prompts, MAX_TOKENS)


def test_merged_adapters_serve_as_ordinary_weights(tiny_swiftkv_lora_serving, tiny_swiftkv_lora):
    """A serving export of a model distilled with adapters (lora_rank > 0): merged into o_proj and the MLP, it
    is the published format, and vLLM's greedy outputs equal HF's on it; HF's logits on the export equal those of
    the full checkpoint (adapters apart, which vLLM refuses, naming the export) to float rounding (greedy paths of
    a random tiny model can part on such rounding, so the logits are compared)."""
    from swiftkv_core.generation import load

    prompts = random_prompts(seed=4)
    with vllm_engine(tiny_swiftkv_lora_serving) as llm:
        got = greedy(llm, prompts, MAX_TOKENS)
    assert got == hf_greedy(tiny_swiftkv_lora_serving, prompts, MAX_TOKENS)
    (merged, _), (apart, _) = load(tiny_swiftkv_lora_serving), load(tiny_swiftkv_lora)
    assert merged.config.lora_rank == 0 and apart.config.lora_rank == 8
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            torch.testing.assert_close(merged(ids).logits, apart(ids).logits, rtol=1e-4, atol=1e-4)
    refused = pytest.raises(Exception, match=r"keeps low-rank adapters apart \(lora_rank=8.*serving export")
    with refused, vllm_engine(tiny_swiftkv_lora):
        pass


def test_default_compilation_mode_matches_hf(tiny_swiftkv):
    """vLLM's default (torch.compile mode, what `vllm serve` runs without --enforce-eager): the SwiftKV model's
    two compile units (self-decoder, cross-decoder) are really compiled, and the outputs still match."""
    from vllm.compilation.counter import compilation_counter

    def compile_state(model):
        # A compiled function in use: torch.compile's AOT artifact (vLLM's default with torch >= 2.10, compiled
        # now or loaded from vLLM's compile cache) or dynamo's transformed bytecode.
        return [
            (
                type(unit).__name__,
                unit.do_not_compile,
                getattr(unit, "aot_compiled_fn", None) is not None
                or getattr(unit, "_compiled_bytecode", None) is not None,
            )
            for unit in (model.model.self_decoder, model.model.cross_decoder)
        ]

    models_seen = compilation_counter.num_models_seen
    prompts = random_prompts(seed=6)
    with vllm_engine(tiny_swiftkv, enforce_eager=False) as llm:
        got = greedy(llm, prompts, MAX_TOKENS)
        state = llm.apply_model(compile_state)[0]
    assert compilation_counter.num_models_seen - models_seen == 2
    assert state == [("SwiftKVSelfDecoder", False, True), ("SwiftKVCrossDecoder", False, True)]
    assert got == hf_greedy(tiny_swiftkv, prompts, MAX_TOKENS)


def test_qwen2_matches_hf(tiny_qwen2_swiftkv):
    prompts = random_prompts(seed=4)
    with vllm_engine(tiny_qwen2_swiftkv) as llm:
        got = greedy(llm, prompts, MAX_TOKENS)
    assert got == hf_greedy(tiny_qwen2_swiftkv, prompts, MAX_TOKENS)


# --- SmolLM2-135M-Instruct (30 layers), converted at l=15 ---
SMOLLM2_VARIANTS = {"l30": (30, 1), "l15-g1": (15, 1), "l15-g3": (15, 3)}


@pytest.fixture(scope="module")
def smollm2_runs(checkpoints, smollm2):
    """Greedy outputs and KV capacity of the stock base model and of its SwiftKV versions, same prompts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = (
        "The history of the bicycle begins in the early nineteenth century, when inventors in Europe built "
        "two-wheeled machines pushed along by the rider's feet. Pedals arrived decades later, and the safety "
        "bicycle, with two wheels of equal size and a chain drive, made cycling popular around the world. "
        "Today bicycles are used for transport, sport and leisure, and cities build lanes to keep riders safe. "
    ) * 3
    ids = tokenizer(text)["input_ids"]
    prompts = [ids[:n] for n in PROMPT_LENGTHS]
    paths = {"base": smollm2}
    for name, (l, g) in SMOLLM2_VARIANTS.items():
        paths[name] = swiftkv_checkpoint(smollm2, checkpoints / f"smollm2-{name}", l, g)
    runs = {}
    for name, path in paths.items():
        with vllm_engine(path) as llm:
            cache_config = llm.llm_engine.vllm_config.cache_config
            runs[name] = {
                "tokens": greedy(llm, prompts, MAX_TOKENS),
                "blocks": cache_config.num_gpu_blocks,
                "fast_prefill": cache_config.kv_sharing_fast_prefill,
            }
    return prompts, paths, runs


@pytest.mark.parametrize("variant", ["l15-g1", "l15-g3"])
def test_smollm2_swiftkv_matches_hf(smollm2_runs, variant):
    prompts, paths, runs = smollm2_runs
    assert runs[variant]["fast_prefill"]
    assert runs[variant]["tokens"] == hf_greedy(paths[variant], prompts, MAX_TOKENS)


def test_smollm2_no_skipped_layer_equals_stock_llama(smollm2_runs):
    """num_key_value_layers == num_hidden_layers: the SwiftKV model is the base Llama, token for token."""
    _, _, runs = smollm2_runs
    assert runs["l30"]["tokens"] == runs["base"]["tokens"]
    assert not runs["l30"]["fast_prefill"]


@pytest.mark.parametrize(
    ("variant", "factor"), [("l30", 1.0), ("l15-g1", 1.0), ("l15-g3", 30 / (15 + 15 / 3))]
)
def test_kv_capacity_grows_with_acrosskv(smollm2_runs, variant, factor):
    """Same cache space: capacity grows by L / (l + (L - l) / g) (1.5x for l=15, g=3 on 30 layers)."""
    _, _, runs = smollm2_runs
    assert runs[variant]["blocks"] / runs["base"]["blocks"] == pytest.approx(factor, rel=0.01)
