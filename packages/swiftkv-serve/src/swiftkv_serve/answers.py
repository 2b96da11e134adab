"""A teacher's answers to chat prompts, generated with vLLM in batches (distillation data).

``generate_answers(model, prompts)`` poses each prompt to ``model`` as one user turn (the tokenizer's chat
template, with the generation prompt, exactly as ``transformers`` would) and samples an answer. Every request
has its own seed (``seed + index``), so an answer depends on its prompt, its index and the settings only: not
on which other prompts share a batch, nor on vLLM's scheduling.

The engine runs in a child process (``python -m swiftkv_serve.answers``): an in-process vLLM engine on CPU
binds the caller's threads and keeps its KV cache and worker state alive until the interpreter exits, and the
caller (the quickstart) trains with Lightning afterwards in the same process. The child's start-up (vLLM import,
engine) is a few tens of seconds, small next to the generation itself.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

KV_CACHE_GIB = 4  # room for 256 answers at once of a small chat model; fixed, so CPU memory is not all taken


def _sampling_params(count: int, max_new_tokens: int, temperature: float, top_p: float, seed: int):
    from vllm import SamplingParams

    return [
        SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed + i,
            skip_special_tokens=True,
        )
        for i in range(count)
    ]


def chat_prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as one user turn, followed by the assistant's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{tokenizer.name_or_path}: the tokenizer has no chat template, so prompts cannot be posed to the model."
        )
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in prompts
    ]


def _progress_tqdm():
    """A tqdm class for vLLM's ``use_tqdm`` that reports "PROGRESS done total" lines on stdout (to the parent)."""
    from tqdm import tqdm

    class ProgressLines(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115  (closed in close())
            super().__init__(*args, **kwargs)
            self._last_report = 0.0

        def update(self, n=1):
            result = super().update(n)
            now = time.monotonic()
            if now - self._last_report > 2 or self.n == self.total:
                self._last_report = now
                print(f"PROGRESS {self.n} {self.total}", flush=True)
            return result

        def close(self):
            file = self.fp
            super().close()
            file.close()

    return ProgressLines


def generate_in_process(
    model: str | Path,
    prompts: list[str],
    max_new_tokens: int = 160,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    report_progress: bool = False,
    engine_options: dict | None = None,
) -> list[str]:
    """``generate_answers`` in THIS process (one ``vllm.LLM``, shut down afterwards)."""
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = chat_prompt_ids(tokenizer, prompts)
    if not prompt_ids:
        return []
    options = dict(
        dtype="float32" if not torch.cuda.is_available() else "auto",
        enforce_eager=True,
        max_model_len=max(len(p) for p in prompt_ids) + max_new_tokens,
        kv_cache_memory_bytes=KV_CACHE_GIB * 2**30,
        enable_prefix_caching=False,
        # vLLM 0.32 rewinds a seeded request's generator after a partial prefill chunk (gpu_model_runner:
        # gen.set_offset), which CPU generators refuse ("CPU Generator does not use offset"): whole prompts only.
        enable_chunked_prefill=False,
        seed=seed,
    )
    options.update(engine_options or {})
    llm = LLM(model=str(model), **options)
    try:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids],
            _sampling_params(len(prompt_ids), max_new_tokens, temperature, top_p, seed),
            use_tqdm=_progress_tqdm() if report_progress else False,
        )
    finally:
        from vllm.distributed import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
    return [output.outputs[0].text for output in outputs]


def generate_answers(
    model: Path,
    prompts: list[str],
    max_new_tokens: int = 160,
    temperature: float = 0.7,
    top_p: float = 0.9,
    seed: int = 0,
    progress: bool = True,
    engine_options: dict | None = None,
) -> list[str]:
    """``model``'s sampled answers to ``prompts`` (one user turn each), in prompt order, generated by vLLM in a
    child process. Reproducible: request ``i`` is sampled with seed ``seed + i``, whatever else is batched.

    Args:
        model: a local HF checkpoint folder with a chat template (stock or SwiftKV).
        prompts: the user messages.
        max_new_tokens: the longest answer, in tokens.
        temperature, top_p: sampling settings.
        seed: the first request's seed.
        progress: show a progress bar (tqdm, on stderr) while answers are generated.
        engine_options: extra ``vllm.LLM`` arguments (e.g. ``max_num_seqs``).
    """
    from tqdm.auto import tqdm

    from .bench import run_module_in_child

    prompts = list(prompts)
    if not prompts:
        return []
    spec = dict(
        model=str(model),
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        report_progress=True,
        engine_options=engine_options,
    )
    # the engine core in the child itself (unless the caller's environment says otherwise)
    env_overrides = {"VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    bar = tqdm(total=len(prompts), desc="teacher answers (vLLM)", unit="answer", disable=not progress)

    def on_line(line: str) -> None:
        parts = line.split()
        if len(parts) == 3 and parts[0] == "PROGRESS" and parts[1].isdigit():
            bar.update(int(parts[1]) - bar.n)

    try:
        answers, _ = run_module_in_child(
            "swiftkv_serve.answers", spec, f"vLLM answer generation on {model}", on_line, env_overrides
        )
    finally:
        bar.close()
    return answers


if __name__ == "__main__":
    from .bench import child_main

    child_main(generate_in_process, *sys.argv[1:])
