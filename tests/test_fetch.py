"""``mpidl data fetch`` against a local HTTP server, never the internet: a file lands whole and
checked or not at all, mirrors are tried in order, and what lands is what ``mpidl train`` reads."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mpidl import cli, data, fetch

#: What a mirror of the test server does with every request: serve the file, answer 404, serve
#: other bytes, send half of the file and close, or send half and then nothing for 10 s.
MODES = ("good", "missing", "wrong", "cut", "stall")


def idx_gz(array: np.ndarray) -> bytes:
    """``array`` (uint8) as a gzipped IDX file."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    return gzip.compress(header + array.tobytes(), mtime=0)


def synthetic_files() -> dict[str, bytes]:
    """A tiny IDX dataset's four files: 6 training and 4 test images of 28x28, labels 0..9."""
    rng = np.random.default_rng(1)
    files = {}
    for split, n in (("train", 6), ("t10k", 4)):
        files[f"{split}-images-idx3-ubyte.gz"] = idx_gz(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        files[f"{split}-labels-idx1-ubyte.gz"] = idx_gz(rng.integers(0, 10, n, dtype=np.uint8))
    return files


FILES = synthetic_files()
SHA256 = {name: hashlib.sha256(blob).hexdigest() for name, blob in FILES.items()}


class Server:
    """A local HTTP server; ``url(mode)`` is a mirror that behaves as ``mode`` (:data:`MODES`)."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                mode, _, name = self.path.strip("/").partition("/")
                blob = FILES.get(name)
                if blob is None or mode == "missing":
                    self.send_error(404)
                    return
                if mode == "wrong":
                    blob = blob[:-1] + bytes([blob[-1] ^ 0xFF])
                self.send_response(200)
                self.send_header("Content-Length", str(len(blob)))
                self.end_headers()
                if mode in ("cut", "stall"):
                    self.wfile.write(blob[: len(blob) // 2])
                    self.wfile.flush()
                    if mode == "stall":
                        time.sleep(10)
                    return
                self.wfile.write(blob)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.http.server_address[1]}/{mode}/"


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.http.shutdown()
    s.http.server_close()


def contents(folder: Path) -> dict[str, bytes]:
    """Every file in ``folder`` (hidden ones too), by name."""
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else {}


def test_fetched_files_land_whole_and_are_what_train_reads(server: Server, tmp_path: Path) -> None:
    """The four files land byte for byte, nothing else is left in the folder, the loader reads
    them; a second fetch checks them and downloads nothing."""
    folder = tmp_path / "mnist"
    paths = fetch.fetch(str(folder), SHA256, [server.url("good")], say=lambda line: None)
    assert contents(folder) == FILES and [Path(p).name for p in paths] == list(FILES)
    ds = data.load_idx("mnist", str(folder))
    assert ds.name == "mnist" and ds.x_train.shape == (6, 784) and ds.x_test.shape == (4, 784)
    assert np.array_equal(
        ds.x_train.reshape(6, 28, 28),
        np.frombuffer(gzip.decompress(FILES["train-images-idx3-ubyte.gz"]), np.uint8, offset=16).reshape(6, 28, 28),
    )
    asked = len(server.requests)
    lines: list[str] = []
    fetch.fetch(str(folder), SHA256, [server.url("good")], say=lines.append)
    assert len(server.requests) == asked and all(line.endswith("present, SHA-256 checked") for line in lines)


def test_a_wrong_checksum_is_refused_and_leaves_nothing(server: Server, tmp_path: Path) -> None:
    """The third file arrives with another SHA-256: refused, naming it, and nothing of it is left;
    the two before it stay (each whole and checked)."""
    bad = dict(SHA256, **{"t10k-images-idx3-ubyte.gz": "0" * 64})
    with pytest.raises(
        fetch.FetchError,
        match=r"t10k-images-idx3-ubyte.gz: no mirror .* SHA-256 [0-9a-f]{64} \(\d+ bytes\), not the official 0{64}",
    ):
        fetch.fetch(str(tmp_path), bad, [server.url("good")], say=lambda line: None)
    names = list(FILES)
    assert contents(tmp_path) == {name: FILES[name] for name in names[:2]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, problem", [("cut", "cut short after"), ("stall", "timed out")])
def test_an_interrupted_download_leaves_nothing(server: Server, tmp_path: Path, mode: str, problem: str) -> None:
    """The server closes the connection half-way (or stops sending past the timeout): the
    download is refused and leaves no file, whole or partial."""
    with pytest.raises(fetch.FetchError, match=problem):
        fetch.fetch(str(tmp_path), SHA256, [server.url(mode)], timeout=1.0, say=lambda line: None)
    assert contents(tmp_path) == {}


def test_the_next_mirror_serves_what_the_first_cannot(server: Server, tmp_path: Path) -> None:
    """A mirror that answers 404, one that serves other bytes, then a good one (given without
    its trailing slash): each file comes from the good one, and a damaged file already in the
    folder is replaced."""
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"not the file")
    mirrors = [server.url(mode) for mode in ("missing", "wrong")] + [server.url("good").rstrip("/")]
    lines: list[str] = []
    fetch.fetch(str(tmp_path), SHA256, mirrors, say=lines.append)
    assert contents(tmp_path) == FILES
    assert server.requests == [f"/{mode}/{name}" for name in FILES for mode in ("missing", "wrong", "good")]
    assert all(line.endswith(f"from {server.url('good')}{name}, SHA-256 checked") for line, name in zip(lines, FILES))


def test_the_command_refuses_files_without_the_official_checksums(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mpidl data fetch --mirror URL``: the test server's files are not the official MNIST,
    so the command exits with 1, says why, and leaves the folder empty."""
    argv = ["data", "fetch", "--dataset", "mnist", "--data-dir", str(tmp_path), "--mirror", server.url("good")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "mpidl data fetch: error: train-images-idx3-ubyte.gz: no mirror" in err
    assert f"not the official {data.IDX_DATASETS['mnist'].sha256['train-images-idx3-ubyte.gz']}" in err
    assert contents(tmp_path) == {}


def test_the_command_fetches_where_train_looks(
    server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--data-dir`` the files go to the user's data folder, where the loader looks
    when it is given none (here with the test files' checksums and the test server as the mirror)."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    source = dataclasses.replace(data.IDX_DATASETS["mnist"], sha256=SHA256, mirrors=(server.url("good"),))
    monkeypatch.setitem(data.IDX_DATASETS, "mnist", source)
    assert cli.main(["data", "fetch", "--dataset", "mnist"]) == 0
    assert contents(tmp_path / "mpidl" / "mnist") == FILES
    assert f"MNIST is in {tmp_path / 'mpidl' / 'mnist'}" in capsys.readouterr().out
    assert data.load_idx("mnist").x_test.shape == (4, 784)
