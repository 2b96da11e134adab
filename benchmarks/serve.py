"""Serving benchmark: the base model in stock vLLM vs its SwiftKV version through the swiftkv_serve plugin.

Same run, same prompts, same engine settings; each model in its own process. ``--suite lengths``: random prompts
of two lengths (``swiftkv_serve.comparison``); ``--suite features``: RAG, extraction, decode-heavy and long-answer
workloads with none / prefix caching / n-gram speculation / both, each against its prefill bound
(``swiftkv_serve.features``, whose docstring says how the bound is measured).

    .venv/bin/python benchmarks/serve.py                                                 # default model, l = L/2
    .venv/bin/python benchmarks/serve.py --num_requests 16 --max_num_seqs 16 --compile true
    .venv/bin/python benchmarks/serve.py --suite features --compile true --num_requests 8 --max_num_seqs 8 \\
        --swiftkv_model runs/smollm2-135m-instruct-l20/distilled-serving --features '[n-gram, both]'

Writes ``benchmarks/results/serve[-compile][-features].{json,png,md}`` (or ``--out``). By default the SwiftKV model is
the base converted at l (published init, not distilled: speed does not depend on the weights); ``--swiftkv_model``
serves a given SwiftKV serving export of the same base instead (a distilled one).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from jsonargparse import auto_cli

from swiftkv_serve.child import ChildProcessFailed
from swiftkv_serve.comparison import KV_CACHE_GIB, compare_serving, converted_export, write_serving_report
from swiftkv_serve.features import FEATURE_WORKLOADS, FEATURES, compare_features
from swiftkv_serve.features_report import write_features_report

RESULTS = Path(__file__).parent / "results"
WORKLOADS = {"2000/200": (2000, 200), "500/500": (500, 500)}


def main(
    model: str = "default",
    num_key_value_layers: int | None = None,
    num_requests: int = 16,
    max_num_seqs: int = 16,
    compile: bool = False,
    out: Path | None = None,
    report_only: bool = False,
    suite: str = "lengths",
    swiftkv_model: Path | None = None,
    features: list[str] | None = None,
    workloads: list[str] | None = None,
) -> None:
    """Stock vLLM vs SwiftKV (through the swiftkv_serve plugin) on the same bursts of requests.

    Args:
        model: base HF checkpoint (default: the embedded SmolLM2-135M-Instruct).
        num_key_value_layers: l of the SwiftKV version (default: num_hidden_layers / 2).
        num_requests: requests per workload burst.
        max_num_seqs: vLLM's max_num_seqs (requests in one batch).
        compile: vLLM's default torch.compile mode for both models (default: eager).
        out: output prefix (default: benchmarks/results/serve, or serve-compile with compile).
        report_only: rewrite the .md/.png from the .json at ``out``.
        suite: ``lengths`` (random prompts of two lengths, no vLLM features) or ``features`` (the workloads of
            swiftkv_serve.features, each with none / prefix caching / n-gram / both).
        swiftkv_model: a SwiftKV serving export of ``model`` to serve (e.g. a distilled one), instead of the
            base converted at l (undistilled); its family and shape must match the base's.
        features: with ``--suite features``, only these feature sets, in this order.
        workloads: with ``--suite features``, only these workloads.
    """
    if suite not in ("lengths", "features"):
        raise SystemExit(f"--suite {suite!r}: use 'lengths' or 'features'.")
    for flag, names, known in (("features", features, FEATURES), ("workloads", workloads, FEATURE_WORKLOADS)):
        if names is not None and (suite != "features" or not names or not set(names) <= set(known)):
            raise SystemExit(f"--{flag} {names}: with --suite features, a non-empty list of {list(known)}.")
    if out is None:
        out = RESULTS / ("serve-compile" if compile else "serve")
        if suite == "features":
            out = out.with_name(out.name + "-features")
    write = write_features_report if suite == "features" else write_serving_report
    if report_only:
        write(json.loads(out.with_suffix(".json").read_text()), out)
        return

    from swiftkv_core.checkpoints import CheckpointError, check_checkpoint, check_swiftkv_version_of

    try:
        base, base_config = check_checkpoint(model, kind="base")
        if swiftkv_model is not None:
            swiftkv = Path(swiftkv_model).expanduser().resolve()
            l = check_swiftkv_version_of(swiftkv, base).num_key_value_layers
            if num_key_value_layers not in (None, l):
                raise SystemExit(
                    f"--num_key_value_layers {num_key_value_layers}, but --swiftkv_model has l={l}."
                )
        else:
            l = num_key_value_layers or base_config.num_hidden_layers // 2
            check_checkpoint(base, l, kind="base")
            swiftkv = converted_export(base, l)
    except CheckpointError as error:
        raise SystemExit(f"benchmarks/serve.py: {error}") from None
    try:
        if suite == "features":
            selected = {name: FEATURES[name] for name in features or FEATURES}
            results = compare_features(
                base, swiftkv, num_requests, max_num_seqs, compile, selected, workloads
            )
        else:
            results = compare_serving(base, swiftkv, WORKLOADS, num_requests, max_num_seqs, compile,
                                      kv_cache_gib=KV_CACHE_GIB, progress=lambda line: print(line, flush=True))  # fmt: skip
    except ChildProcessFailed as error:
        raise SystemExit(str(error)) from None
    results["swiftkv_export"] = str(swiftkv_model) if swiftkv_model is not None else None  # as given
    results["command"] = shlex.join([".venv/bin/python", "benchmarks/serve.py", *sys.argv[1:]])
    write(results, out)


if __name__ == "__main__":
    auto_cli(main, as_positional=False)
