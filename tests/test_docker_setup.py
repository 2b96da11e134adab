"""scripts/docker-setup.sh takes debootstrap's Debian mirror as apt does on this machine (or $DEBIAN_MIRROR);
scripts/docker-context.sh needs no pip on the host."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mirror(etc: Path, **env) -> str:
    script = ROOT / "scripts" / "docker-setup.sh"
    function = subprocess.run(["sed", "-n", "/^debian_mirror()/,/^}/p", str(script)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    result = subprocess.run(["bash", "-c", function + "\ndebian_mirror"], capture_output=True, text=True, check=True,
                            env={"PATH": "/usr/bin:/bin", "APT_ETC": str(etc), **env})  # fmt: skip
    return result.stdout.strip()


def test_the_mirror_comes_from_the_machines_apt_sources(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    assert mirror(tmp_path) == "http://deb.debian.org/debian"  # no sources: Debian's own
    (tmp_path / "sources.list").write_text(
        "deb http://security.debian.org/debian-security bookworm-security main\n"
        "deb [arch=amd64 trusted=yes] http://proxy.example:3142/debian bookworm main\n"
    )
    assert mirror(tmp_path) == "http://proxy.example:3142/debian"
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.example.org/debian-security\nSuites: bookworm-security\n"
    )
    assert mirror(tmp_path) == "http://mirror.example.org/debian"  # deb822 sources first, as apt reads them
    assert mirror(tmp_path, DEBIAN_MIRROR="http://given.example/debian") == "http://given.example/debian"


def test_the_cuda_build_context_needs_no_pip_on_the_host(tmp_path):
    """A GPU machine's python3 may have no pip (pip's settings are read only for a proxy's CA bundle): the context
    is made all the same, where the script used to stop with exit 1 and no word (its pipeline under pipefail)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "docker-context.sh", tmp_path / "scripts")
    venv = tmp_path / "no-pip"  # a real interpreter without pip, first on the PATH
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    assert subprocess.run(
        [venv / "bin" / "python3", "-m", "pip", "--version"], capture_output=True
    ).returncode
    result = subprocess.run(["bash", str(tmp_path / "scripts" / "docker-context.sh"), "cuda"], capture_output=True,
                            text=True, env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    context = tmp_path / "docker" / "context"
    # no proxy, so no CA bundle: nothing else to put there for a CUDA image
    assert context.is_dir() and not list(context.iterdir())
