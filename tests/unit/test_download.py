"""Download code against a real HTTP server on 127.0.0.1 (no internet)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from transformer.download import DownloadError, download, sha256_file


class _Handler(BaseHTTPRequestHandler):
    """Serves files from `server.root`; honours Range unless `server.no_range`.

    `server.fail` is an HTTP status to answer every request with, and `server.truncate` makes
    the server send only that many bytes of the body (after a full Content-Length).
    """

    def do_GET(self) -> None:  # noqa: N802
        server = self.server
        server.requests.append(dict(self.headers))
        if server.fail:
            self.send_error(server.fail)
            return
        path = Path(server.root) / self.path.lstrip("/")
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        range_header = self.headers.get("Range")
        if range_header and not server.no_range:
            start = int(range_header.removeprefix("bytes=").split("-")[0])
            if start >= len(data):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: server.truncate] if server.truncate is not None else body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def serve(root: Path) -> Iterator[tuple[str, ThreadingHTTPServer]]:
    """An HTTP server for `root` on a free 127.0.0.1 port; yields (base URL, server)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.root, server.fail, server.no_range, server.truncate = root, None, False, None
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "site"
    root.mkdir()
    data = bytes(range(256)) * 4000  # ~1 MB, not a multiple of the 1 MiB chunk
    (root / "corpus.bin").write_bytes(data)
    with serve(root) as (url, server):
        yield url, server, data, hashlib.sha256(data).hexdigest()


def test_complete_download_is_verified_and_renamed(site, tmp_path):
    url, _, data, sha = site
    dest = download(url + "corpus.bin", tmp_path / "out" / "corpus.bin", sha)
    assert dest.read_bytes() == data
    assert not (tmp_path / "out" / "corpus.bin.part").exists()


def test_partial_download_resumes_with_range(site, tmp_path):
    url, server, data, sha = site
    dest = tmp_path / "corpus.bin"
    (tmp_path / "corpus.bin.part").write_bytes(data[:300_001])
    download(url + "corpus.bin", dest, sha)
    assert dest.read_bytes() == data
    assert server.requests[-1]["Range"] == "bytes=300001-"


def test_server_ignoring_range_restarts_instead_of_appending(site, tmp_path):
    url, server, data, sha = site
    server.no_range = True
    (tmp_path / "corpus.bin.part").write_bytes(data[:1000])
    assert download(url + "corpus.bin", tmp_path / "corpus.bin", sha).read_bytes() == data


def test_complete_part_file_is_finished_after_416(site, tmp_path):
    url, _, data, sha = site
    (tmp_path / "corpus.bin.part").write_bytes(data)
    assert download(url + "corpus.bin", tmp_path / "corpus.bin", sha).read_bytes() == data


def test_checksum_mismatch_is_an_error_and_leaves_nothing(site, tmp_path):
    url, _, _, _ = site
    dest = tmp_path / "corpus.bin"
    with pytest.raises(DownloadError, match="sha256 mismatch"):
        download(url + "corpus.bin", dest, "0" * 64)
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "site"]


@pytest.mark.parametrize("status", [500, 503, 403])
def test_server_error_is_a_download_error(site, tmp_path, status):
    url, server, _, sha = site
    server.fail = status
    with pytest.raises(DownloadError, match=f"HTTP {status}"):
        download(url + "corpus.bin", tmp_path / "corpus.bin", sha)
    assert not (tmp_path / "corpus.bin").exists()


def test_missing_file_is_404(site, tmp_path):
    url, _, _, _ = site
    with pytest.raises(DownloadError, match="HTTP 404"):
        download(url + "nope.bin", tmp_path / "nope.bin")


def test_truncated_transfer_keeps_part_and_a_retry_resumes(site, tmp_path):
    url, server, data, sha = site
    server.truncate = 5000
    dest = tmp_path / "corpus.bin"
    with pytest.raises(DownloadError, match="retry to resume"):
        download(url + "corpus.bin", dest, sha)
    assert not dest.exists()
    assert (tmp_path / "corpus.bin.part").stat().st_size == 5000
    server.truncate = None
    assert download(url + "corpus.bin", dest, sha).read_bytes() == data
    assert server.requests[-1]["Range"] == "bytes=5000-"


def test_existing_file_is_not_fetched_again(site, tmp_path):
    url, server, data, sha = site
    dest = tmp_path / "corpus.bin"
    dest.write_bytes(data)
    download(url + "corpus.bin", dest, sha)
    assert server.requests == []
    dest.write_bytes(b"other")
    with pytest.raises(DownloadError, match="exists but its sha256"):
        download(url + "corpus.bin", dest, sha)


def test_unreachable_server_is_a_download_error(tmp_path):
    with serve(tmp_path) as (url, _):
        pass  # closed: nothing listens on that port any more
    with pytest.raises(DownloadError):
        download(url + "x", tmp_path / "x", timeout=5)


def test_sha256_file(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    # sha256("abc") from FIPS 180-2, appendix B.1
    assert sha256_file(tmp_path / "a") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
