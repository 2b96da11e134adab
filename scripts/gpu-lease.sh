#!/usr/bin/env bash
# The checks a lent GPU (the `device` tool, ../shared/notes/device-howto.md) is spent on, prepared so a 15-minute lease
# measures instead of setting up. Two halves:
#
#   here:   scripts/gpu-lease.sh prepare           fills the git-ignored .gpu/ (about 25 MiB): the wheels the GPU
#                                                  image lacks (versions from .venv, i.e. uv.lock), the default
#                                                  model's tokenizer and config, the Brown data the distillation
#                                                  batches and the quickstart's held-out figures read
#   there:  bash scripts/gpu-lease.sh run STEP...  (the run tool with carry [".gpu"]) runs each STEP under its own
#                                                  time limit, its whole log in $OUT/STEP.log, one summary line each
# Steps (minutes on an H100 / H200 on 2026-11-26; pick steps to fit a call's 10 minutes and the lease's 15, whose
# start counts too (a minute or two for a fresh machine) and whose idle machine goes back after 30 s):
#   attention   the flex_attention gpu tests, compiled layers (flex_attention and sdpa) among them (1.3)
#   tests       the other gpu tests of swiftkv-core and swiftkv-distill, real compiled fits among them (2.5)
#   prefill     benchmarks/gpu.py: the 2k, 8k and 8 x 2k packed prefills, eager and compiled with CUDA graphs, against
#               the FLOPs bound and the memory-aware one, and the decode TPOT after 2k, off vs on (4; the same with 2k
#               alone, benchmarks/gpu.py run by hand: 3.8)
#   prefill-dynamic  the main job's compiled prefill at 512 and 2048 tokens, compiled per length (as now) and once
#               with dynamic shapes: compile times and timed forwards (benchmarks/results/prefill-compile-dynamic.py;
#               not yet run on a GPU: about 4 by the H100's 55 s per static length)
#   profile     benchmarks/gpu_profile.py: the 2k prefill's CUDA profile, off and on, then each decoder layer compiled
#               (regional, static shapes); its row in gpu-prefill-profile.md is to be measured again (not yet run
#               with enough recompiles: 50 layer graphs at 32 layers on the CPU, a few seconds each; about 5)
#   distill     benchmarks/gpu.py: the 8B distillation step, bf16 frozen weights, eager, compiled layers, activation
#               checkpointing (2 on an H200, about 3.4 on an H100); GPU_LEASE_DISTILL_FLAGS replaces the last two
#               (e.g. '--compile_layers true' alone; empty: eager alone)
#   quickstart  the main job on the GPU (`--accelerator gpu`, short settings, no serving: vLLM cannot run there)
#               with RANDOM weights of the default model's shape (the real weights exceed what a call carries):
#               it checks that every stage runs on the GPU, not the quality figures (5.3, of which 1.8 compile the
#               prefill's CUDA graphs)
# A dry run here, on the CPU, after prepare (the script's wiring, not the figures): GPU_LEASE_DRY_RUN=1 bash
#   scripts/gpu-lease.sh run attention tests quickstart takes this machine's .venv instead of installing the wheels,
#   runs the quickstart on the CPU, each limit x4 (the gpu tests skip; the quickstart takes 9-16 minutes on 2
#   cores); the other steps need a GPU
# A 15-minute lease as spent on 2026-11-26 (H200): the timings alone on the GPU, after the test they rest on,
#   bash scripts/gpu-lease.sh run attention distill                                                    (3.5 min)
# then at once (within the 30 s) the correctness steps beside the quickstart (5 min; shared, so untimed),
#   bash scripts/gpu-lease.sh run tests >$OUT/correctness.txt 2>&1 & bash scripts/gpu-lease.sh run quickstart; \
#   wait; cat $OUT/correctness.txt
# A 15-minute lease as spent on 2026-11-27 (H100): bash scripts/gpu-lease.sh run attention tests distill (7.2 min).
# Never run yet, for the next lease: bash scripts/gpu-lease.sh run profile, then run prefill-dynamic (about 5 + 4 min).
# The steps of one call share its 570 s (GPU_LEASE_CALL_SECONDS): a step gets at most what the ones before it left.
# With under 10 minutes of device time left, the run tool's own limit is shorter and would cut the call before a step's
# limit: give GPU_LEASE_CALL_SECONDS=(the seconds left - 30) on the command line.
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
    set -e
    grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >>.git/info/exclude
    [[ -x .venv/bin/python ]] || scripts/setup.sh
    local py=.venv/bin/python pins=() name
    # what the GPU image lacks or has at another version (device-howto.md); huggingface-hub stays the image's own
    for name in transformers tokenizers omegaconf datasets dill multiprocess jsonargparse docstring-parser \
        typeshed-client gguf; do
        pins+=("$name==$($py -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
    done
    rm -rf .gpu/whl && mkdir -p .gpu/whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl "${pins[@]}"
    # the default model's tokenizer and config, and the Brown text, from this machine's cache (made if missing)
    local files
    files=$($py -c "
import contextlib, sys
from swiftkv_core.default_model import default_model_path
from swiftkv_distill.corpora import prepare
with contextlib.redirect_stdout(sys.stderr):  # what making them prints is the user's, not read's
    paths = default_model_path(), prepare('brown_train'), prepare('brown_heldout')
print(*paths)")
    read -r model brown heldout <<<"$files"
    local target=.gpu/cache/models/SmolLM2-135M-Instruct
    mkdir -p "$target" .gpu/cache/data/distill
    cp "$model"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} "$target/"
    : >"$target/model.safetensors" # a placeholder that marks the folder complete: tests build their own weights
    cp "$brown" "$heldout" .gpu/cache/data/distill/ # the quickstart step's held-out text too: no npm there
    echo "gpu-lease: .gpu/ ready ($(du -sh .gpu | cut -f1)); on the device: bash scripts/gpu-lease.sh run STEP..."
}

random_default_model() {
    # the default model's architecture and tokenizer with random weights (seeded), built on the GPU where there is one
    local target=$1
    python3 - "$target" <<'EOF'
import shutil, sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from swiftkv_core.default_model import default_model_path

source, target = default_model_path(materialise=False), Path(sys.argv[1])
torch.manual_seed(0)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.bfloat16)
model.save_pretrained(target)
for f in source.iterdir():
    if f.name.startswith(("tokenizer", "chat_template")):
        shutil.copy(f, target / f.name)
print(f"random weights of {source.name}'s shape in {target}")
EOF
}

run_step() {
    local step=$1 limit command accelerator=gpu
    [[ $dry_run == 1 ]] && accelerator=cpu
    case $step in
    attention)
        limit=240
        command="python3 -m pytest -m gpu tests/distill/test_attention.py -q -p no:cacheprovider --tb=short" ;;
    tests)
        limit=300
        command="python3 -m pytest -m gpu tests/core/test_gpu.py tests/core/test_runtime.py tests/core/test_kv_cache.py \
tests/core/test_attention.py tests/distill/test_gpu.py tests/distill/test_module.py -q -p no:cacheprovider --tb=short" ;;
    prefill)
        limit=480
        command="python3 benchmarks/gpu.py --parts '[prefill,decode]' --prefill_lengths '[2048,8192]' --prefill_compile reduce-overhead \
--out $OUT/gpu-prefill" ;;
    profile)
        limit=540
        command="python3 benchmarks/gpu_profile.py" ;;
    distill)
        limit=540
        command="python3 benchmarks/gpu.py --parts '[distill]' --frozen '[bf16]' \
${GPU_LEASE_DISTILL_FLAGS---activation_checkpointing true --compile_layers true} --out $OUT/gpu-distill" ;;
    prefill-dynamic)
        limit=420
        command="for kind in static dynamic; do TORCHINDUCTOR_CACHE_DIR=\$(mktemp -d) \
python3 benchmarks/results/prefill-compile-dynamic.py \$kind cuda || exit \$?; done" ;;
    quickstart)
        limit=420
        command="random_default_model /tmp/smollm2-random && python3 -m swiftkv.cli quickstart --model /tmp/smollm2-random \
--accelerator $accelerator --out /tmp/quickstart-gpu --budget_minutes 2 --serve false --train_files '[dataset:brown_train]' \
--heldout_chat_prompts '' --max_eval_rows 16 --prompt_lengths '[512,2048]' && cp /tmp/quickstart-gpu/report.md \
$OUT/quickstart-report.md" ;;
    esac
    [[ $dry_run == 1 ]] && limit=$((4 * limit))
    # the call's own limit (the run tool's 600 s) bounds the steps together: a step gets what is left of it, and
    # one with under a minute left is not started (rerun it in the next call); benchmarks/gpu.py writes each row
    # as it is measured, so a step cut short keeps its rows
    local left=$((call_seconds - (SECONDS - call_started)))
    if ((left < 60)); then
        echo "[gpu-lease] $step: not started, ${left} s left of the call's ${call_seconds} s (GPU_LEASE_CALL_SECONDS)"
        return 1
    fi
    ((limit > left)) && limit=$left
    local started=$SECONDS rc
    echo "[gpu-lease] $step: $command"
    # each step under its own limit, so a hung step leaves the others, and the call, their time: SIGKILL to the
    # step's whole process group (Lightning catches SIGTERM and would train on beside the next step)
    timeout --signal KILL "$limit" bash -c "$command" >"$OUT/$step.log" 2>&1
    rc=$?
    echo "[gpu-lease] $step: exit $rc in $((SECONDS - started)) s$([[ $rc == 137 ]] && echo " (killed at its ${limit}-s limit?)"); \
last lines of $step.log:"
    tail -n 8 "$OUT/$step.log" | sed 's/^/    /'
    return $rc
}

run() {
    call_started=$SECONDS
    [[ $# -gt 0 ]] || { echo "usage: bash scripts/gpu-lease.sh run STEP... (attention tests prefill prefill-dynamic profile distill quickstart)" >&2; exit 2; }
    [[ -d .gpu/whl ]] || { echo "gpu-lease: no .gpu/ here: run scripts/gpu-lease.sh prepare first, carry [\".gpu\"]" >&2; exit 2; }
    local step
    for step in "$@"; do # every name checked before any device time is spent
        [[ " attention tests prefill prefill-dynamic profile distill quickstart " == *" $step "* ]] \
            || { echo "gpu-lease: unknown step '$step': choose from attention, tests, prefill, prefill-dynamic, profile, distill, quickstart" >&2; exit 2; }
    done
    if [[ $dry_run == 1 ]]; then
        for step in "$@"; do
            [[ " attention tests quickstart " == *" $step "* ]] \
                || { echo "gpu-lease: step '$step' needs a GPU; a dry run takes attention, tests, quickstart" >&2; exit 2; }
        done
        export PATH=$PWD/.venv/bin:$PATH # this machine's packages: nothing to install
    fi
    OUT=${OUT:-/tmp/gpu-lease-out}
    mkdir -p "$OUT"
    # once per machine: a second run beside the first (correctness steps beside the quickstart) must not reinstall
    # the packages under the first's imports
    (
        flock 9
        [[ $dry_run == 1 || -e /tmp/site/.gpu-lease-installed ]] && exit 0
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .gpu/whl/*.whl && touch /tmp/site/.gpu-lease-installed
    ) 9>/tmp/gpu-lease-install.lock || exit 1
    export OUT SWIFTKV_CACHE_DIR=$PWD/.gpu/cache PYTHONUNBUFFERED=1 \
        PYTHONPATH=/tmp/site:$PWD/packages/swiftkv-core/src:$PWD/packages/swiftkv-distill/src:$PWD/packages/swiftkv-serve/src:$PWD/packages/swiftkv/src:$PWD
    export -f random_default_model
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/[gpu-lease] /'
    python3 -c "import torch, transformers; print(f'[gpu-lease] torch {torch.__version__}, transformers {transformers.__version__}')"
    local failed=0
    for step in "$@"; do
        run_step "$step" || failed=$((failed + 1))
    done
    echo "[gpu-lease] $# steps, $failed failed; logs in \$OUT"
    return $((failed > 0))
}

dry_run=${GPU_LEASE_DRY_RUN:-0}
call_seconds=${GPU_LEASE_CALL_SECONDS:-570} # under the run tool's 600 s a call, its summary lines included
[[ $dry_run == 1 ]] && call_seconds=${GPU_LEASE_CALL_SECONDS:-100000}
case ${1:-} in
prepare) prepare ;;
run) shift; run "$@" ;;
*) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2 ;;
esac
