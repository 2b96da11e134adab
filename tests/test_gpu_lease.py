"""scripts/gpu-lease.sh runs every `gpu` test a lent machine can run: a file of them that no step names would never
run on a GPU. vLLM cannot run there (device-howto.md): its files are the CUDA images' (docker/README.md)."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
NEEDS_VLLM = {"tests/integration/test_eval.py", "tests/serve/test_fp8_kv.py", "tests/serve/test_gpu.py"}


def test_every_file_of_gpu_tests_is_in_a_lease_step():
    marked = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if path != Path(__file__) and re.search(r"\bpytest\.mark\.gpu\b", path.read_text())
    }
    script = (ROOT / "scripts" / "gpu-lease.sh").read_text().splitlines()
    named = {
        path
        for line in script
        if not line.lstrip().startswith("#")
        for path in re.findall(r"tests/[\w/]+\.py", line)
    }
    assert marked >= NEEDS_VLLM, "a file said to need vLLM has no gpu test: take it out of NEEDS_VLLM"
    assert all("vllm" in (ROOT / path).read_text() for path in NEEDS_VLLM)
    unrun = marked - NEEDS_VLLM - named
    assert not unrun, f"gpu tests no lease step runs: {sorted(unrun)}"
