"""A teacher's answers to chat prompts, generated with vLLM in batches (distillation data): the ``vllm`` answer
backend (an entry point of ``swiftkv_core.chat.ANSWER_BACKENDS`` in this package's pyproject.toml).

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


def _progress_tqdm():
    """A tqdm class for vLLM's ``use_tqdm`` that reports "PROGRESS done total phase" lines on stdout (to the
    parent). vLLM runs it once per phase: "Rendering prompts" (the requests added), then "Processed prompts"."""
    from tqdm import tqdm

    class ProgressLines(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115  (closed in close())
            super().__init__(*args, **kwargs)
            self._last_report = 0.0

        def update(self, n=1):
            result = super().update(n)
            if time.monotonic() - self._last_report > 2:
                self._report()
            return result

        def _report(self):
            self._last_report = time.monotonic()
            print(f"PROGRESS {self.n} {self.total} {self.desc}", flush=True)

        def close(self):
            if not self.disable:  # the final count (iterating, tqdm counts the last items without update())
                self._report()
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

    from swiftkv_core.chat import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = chat_prompt_ids(tokenizer, prompts)
    if not prompt_ids:
        return []
    check_context(model, [len(ids) for ids in prompt_ids], max_new_tokens, engine_options)
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
        llm.llm_engine.engine_core.shutdown()
        del llm
        release_engine_memory()
    return [output.outputs[0].text for output in outputs]


def check_context(
    model: str | Path, prompt_lengths: list[int], max_new_tokens: int, engine_options: dict | None = None
) -> None:
    """Raise ``ValueError`` naming the prompts that, with their answers, exceed ``model``'s context: before the
    engine starts (vLLM refuses its whole run then, for one prompt). The context: ``max_model_len`` where the engine's
    options give one, else the config's ``max_position_embeddings``, what vLLM derives for the Llama and Qwen2 RoPE
    types (llama3, yarn, default; a linear or dynamic factor it would multiply in is not: refused here)."""
    from transformers import AutoConfig

    context = (engine_options or {}).get("max_model_len") or getattr(
        AutoConfig.from_pretrained(model), "max_position_embeddings", None
    )
    too_long = [i for i, n in enumerate(prompt_lengths) if context and n + max_new_tokens > context]
    if too_long:
        raise ValueError(
            f"{len(too_long)} prompt(s) (indices {too_long[:5]}{' ...' if len(too_long) > 5 else ''}; the longest "
            f"{max(prompt_lengths[i] for i in too_long)} tokens) plus max_new_tokens={max_new_tokens} exceed {model}'s "
            f"context of {context} tokens: shorten or leave out those prompts, or lower max_new_tokens."
        )


def release_engine_memory() -> None:
    """After a ``vllm.LLM``'s engine is shut down and its last reference dropped: its process group and cached
    device memory given back, so that a second engine in the same process (another model) finds the GPU free."""
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


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
    from transformers import AutoTokenizer

    from swiftkv_core.chat import chat_prompt_ids, check_sampling

    from .child import run_module_in_child

    check_sampling(max_new_tokens, temperature, top_p)  # here, not after the child's engine start
    prompts = list(prompts)
    if not prompts:
        return []
    lengths = [len(ids) for ids in chat_prompt_ids(AutoTokenizer.from_pretrained(model), prompts)]
    check_context(model, lengths, max_new_tokens, engine_options)  # here too: before the child starts
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
    title = "teacher answers (vLLM)"
    answering = "Processed prompts"  # vLLM's name for its last phase, the answers
    bar = tqdm(total=len(prompts), desc=title, unit="answer", disable=not progress)
    phase = [answering]

    def on_line(line: str) -> None:
        parts = line.split(maxsplit=3)
        if len(parts) == 4 and parts[0] == "PROGRESS" and parts[1].isdigit() and parts[2].isdigit():
            if parts[3] != phase[0]:  # a new phase starts its own count (vLLM's rendering, then the answers)
                phase[0] = parts[3]
                bar.reset(total=int(parts[2]))
                bar.set_description(title if parts[3] == answering else f"{title}: {parts[3].lower()}")
                bar.unit = "answer" if parts[3] == answering else "prompt"
            bar.update(int(parts[1]) - bar.n)
            if bar.n == bar.total:
                bar.refresh()  # a phase's last count is drawn, however soon after the one before it came

    try:
        answers, _ = run_module_in_child(
            "swiftkv_serve.answers", spec, f"vLLM answer generation on {model}", on_line, env_overrides
        )
    finally:
        bar.close()
    return answers


if __name__ == "__main__":
    from .child import child_main

    child_main(generate_in_process, *sys.argv[1:])
