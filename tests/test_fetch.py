"""`python -m evaluation.fetch` against a real HTTP server on localhost: pinned files land where the loader reads
them, checked by sha256 before they are renamed into place; archives are unpacked safely; nothing is left behind
by a failed or altered download."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
import zipfile
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from evaluation import fetch
from evaluation.benchmarks import BENCHMARKS, build_benchmark
from evaluation.benchmarks.sources import DataSource, Download
from evaluation.benchmarks.sugarcrepe import SUBSETS, SugarCrepe
from testkit.standin.sugarcrepe import write_sugarcrepe


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep the test output clean
        pass


@pytest.fixture
def server(tmp_path):
    """A real HTTP server over `tmp_path/served`; yields (folder, base URL)."""
    served = tmp_path / "served"
    served.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def publish(served: Path, base: str, relative: str, data: bytes, target: str, unpack: str = "",
            pinned: bytes | None = None) -> Download:
    """Serve `data` at `relative` and return its Download, pinned to `pinned` (default: the served bytes)."""
    path = served / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    expected = data if pinned is None else pinned
    return Download(f"{base}/{relative}", target, hashlib.sha256(expected).hexdigest(), len(expected), unpack)


def test_a_file_is_fetched_checked_and_skipped_the_second_time(server, tmp_path):
    served, base = server
    download = publish(served, base, "repo/abc123/data/file.json", b'{"a": 1}', "sub/file.json")
    root = tmp_path / "bench"
    assert fetch.fetch_one(root, download) == "fetched"
    assert (root / "sub" / "file.json").read_bytes() == b'{"a": 1}'
    assert not list(root.rglob("*.part"))
    (served / "repo/abc123/data/file.json").unlink()  # a second run must not need the server
    assert fetch.fetch_one(root, download) == "present"


def test_altered_bytes_are_refused_and_leave_nothing(server, tmp_path):
    served, base = server
    download = publish(served, base, "f.json", b"tampered", "f.json", pinned=b"original")  # same size, other bytes
    root = tmp_path / "bench"
    with pytest.raises(fetch.FetchError, match="sha256 .* is not the pinned"):
        fetch.fetch_one(root, download)
    assert not (root / "f.json").exists() and not list(root.rglob("*.part"))
    short = publish(served, base, "g.json", b"abc", "g.json", pinned=b"abcdef")
    with pytest.raises(fetch.FetchError, match="got 3 bytes, expected 6"):
        fetch.fetch_one(root, short)
    missing = Download(f"{base}/nothing-here.json", "n.json", "0" * 64, 10)
    with pytest.raises(fetch.FetchError, match="404"):
        fetch.fetch_one(root, missing)
    assert sorted(p.name for p in root.iterdir()) == []


def test_an_existing_target_with_other_bytes_is_an_error_not_overwritten(server, tmp_path):
    served, base = server
    download = publish(served, base, "f.json", b"pinned", "f.json")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "f.json").write_bytes(b"a user's edit")
    with pytest.raises(fetch.FetchError, match="delete it to fetch the pinned file"):
        fetch.fetch_one(tmp_path / "bench", download)
    assert (tmp_path / "bench" / "f.json").read_bytes() == b"a user's edit"


def _zip(members: dict) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_archives_are_unpacked_into_the_targets_folder_and_stamped(server, tmp_path):
    served, base = server
    archive = _zip({"prod/atom/complexity_4.csv": "a,b\n1,2\n", "prod/swap/complexity_4.csv": "a,b\n3,4\n"})
    download = publish(served, base, "x/prod.zip", archive, "data/prod.zip", unpack="zip")
    root = tmp_path / "bench"
    assert fetch.fetch_one(root, download) == "fetched"
    assert (root / "data/prod/atom/complexity_4.csv").read_text() == "a,b\n1,2\n"
    assert not (root / "data/prod.zip").exists()
    assert json.loads((root / fetch.STAMP_FILE).read_text()) == {"data/prod.zip": download.sha256}
    assert fetch.fetch_one(root, download) == "present"

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("images/a.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    tarred = publish(served, base, "x/images.tar.gz", buffer.getvalue(), "images.tar.gz", unpack="tar")
    assert fetch.fetch_one(root, tarred) == "fetched"
    assert (root / "images/a.txt").read_bytes() == b"hi"


def test_archive_members_outside_the_folder_are_refused(server, tmp_path):
    served, base = server
    download = publish(served, base, "evil.zip", _zip({"../escaped.txt": "x"}), "evil.zip", unpack="zip")
    with pytest.raises(fetch.FetchError, match="members outside the target folder"):
        fetch.fetch_one(tmp_path / "bench", download)
    assert not (tmp_path / "escaped.txt").exists()


def test_cli_fetches_a_registered_benchmark_through_a_mirror_and_the_loader_reads_it(server, tmp_path, monkeypatch,
                                                                                   capsys):
    """The command end to end: a registry name, `--mirror`, the layout the benchmark reads."""
    served, base = server
    write_sugarcrepe(tmp_path / "official", n_items=14, seed=0)  # official-format files to publish
    downloads = []
    for subset in SUBSETS:
        data = (tmp_path / "official" / f"{subset}.json").read_bytes()
        url_path = f"raw.example.org/owner/repo/0123abc/data/{subset}.json"
        pinned = publish(served, base, url_path, data, f"{subset}.json")
        downloads.append(Download(f"https://raw.example.org/owner/repo/0123abc/data/{subset}.json", pinned.target,
                                  pinned.sha256, pinned.size))
    source = DataSource("https://example.org", "MIT", "7 small files", tuple(downloads), by_hand="images: <root>/x")
    monkeypatch.setattr(SugarCrepe, "data_source", source)
    fetch.main(["--benchmarks", "sugarcrepe", "--data-root", str(tmp_path / "data"), "--mirror", base])
    printed = capsys.readouterr().out
    assert printed.count("sugarcrepe: fetched") == 7
    assert f"by hand: images: {tmp_path / 'data' / 'sugarcrepe'}/x" in printed
    benchmark = build_benchmark("sugarcrepe", tmp_path / "data" / "sugarcrepe")
    assert len(benchmark.items()) == len(build_benchmark("sugarcrepe", tmp_path / "official").items())
    fetch.main(["--benchmarks", "sugarcrepe", "--data-root", str(tmp_path / "data"), "--mirror", base])
    assert capsys.readouterr().out.count("sugarcrepe: present") == 7


def test_cli_reports_failures_with_status_one_and_keeps_the_others(server, tmp_path, monkeypatch):
    served, base = server
    good = publish(served, base, "good.json", b"{}", "good.json")
    bad = publish(served, base, "bad.json", b"xx", "bad.json", pinned=b"yy")
    monkeypatch.setattr(SugarCrepe, "data_source", DataSource("h", "MIT", "2 files", (good, bad)))
    with pytest.raises(SystemExit, match="1 download\\(s\\) failed:\nsugarcrepe: .*bad.json"):
        fetch.main(["--benchmarks", "sugarcrepe", "--data-root", str(tmp_path)])
    assert (tmp_path / "sugarcrepe" / "good.json").read_bytes() == b"{}"


def test_cli_refuses_unknown_names_and_needs_names_or_all(capsys):
    with pytest.raises(SystemExit):
        fetch.main(["--benchmarks", "sugarcrepe,no_such_benchmark"])
    assert "unknown benchmark(s) no_such_benchmark" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fetch.main([])
    assert "one of the arguments --benchmarks --all is required" in capsys.readouterr().err


def test_every_registered_source_is_complete_and_its_downloads_are_pinned():
    for name, cls in BENCHMARKS.items():
        source = cls.data_source
        assert isinstance(source, DataSource), name
        for download in source.downloads:
            assert download.url.startswith("https://"), (name, download.url)
            # a pinned revision: a full git commit in the raw URL, never a branch name
            if "raw.githubusercontent.com" in download.url:
                commit = download.url.split("/")[5]
                assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit), (name, download.url)
