"""scripts/docker-setup.sh takes debootstrap's Debian mirror as apt does on this machine (or $DEBIAN_MIRROR)."""

from __future__ import annotations

import subprocess
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
