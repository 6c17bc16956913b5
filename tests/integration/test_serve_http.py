"""`transformer serve` as a real server on 127.0.0.1, driven by a real HTTP client."""

from __future__ import annotations

import json
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fixtures import make_model_file, multi30k_lines, running_server

httpx = pytest.importorskip("httpx2")  # starlette's recommended client
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_file(tmp_path_factory.mktemp("http"))
    # A wide batching window so that the concurrent requests below share a batch.
    flags = ("--max-request-bytes", "20000", "--max-sentences", "8", "--batch-wait-ms", "300")
    with running_server(model, *flags) as url:
        yield url


def _post(url: str, body: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}/v1/translate", content=body, headers=headers, timeout=60)


def _still_serving(url: str) -> None:
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    response = httpx.post(f"{url}/v1/translate", json={"text": "A dog runs."}, timeout=60)
    assert response.status_code == 200 and response.json()["results"][0]["translations"]


def test_translate_many_sentences_with_options(server, shared_data):  # noqa: ARG001
    lines = multi30k_lines("test_2016_flickr", "en", 5)
    body = {"texts": lines, "beam_size": 3, "length_penalty": 0.6, "n_best": 2}
    response = httpx.post(f"{server}/v1/translate", json=body, timeout=60)
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["source"] for r in results] == lines
    assert all(len(r["translations"]) == 2 for r in results)
    info = httpx.get(f"{server}/v1/model", timeout=10).json()
    assert info["tgt_lang"] == "de" and info["limits"]["max_sentences"] == 8


def test_concurrent_requests_are_batched_and_all_succeed(server, shared_data):  # noqa: ARG001
    lines = multi30k_lines("test_2016_flickr", "en", 12)
    before = httpx.get(f"{server}/health", timeout=10).json()

    def one(line: str) -> str:
        response = httpx.post(f"{server}/v1/translate", json={"text": line}, timeout=120)
        response.raise_for_status()
        return response.json()["results"][0]["source"]

    with ThreadPoolExecutor(len(lines)) as pool:
        assert list(pool.map(one, lines)) == lines
    after = httpx.get(f"{server}/health", timeout=10).json()
    assert after["requests"] - before["requests"] == len(lines)
    assert after["batches"] - before["batches"] < len(lines)  # some requests shared a batch
    assert after["largest_batch"] > 1


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b'{"text": "A dog', 400, "malformed_json"),
        (b"\xff\xfe", 400, "malformed_json"),
        (b'{"texts": [""]}', 422, "empty_input"),
        (b'{"text": "A dog.", "temperature": 0.7}', 422, "unknown_option"),
        (b'{"text": "A dog.", "beam_size": -1}', 422, "invalid_option"),
        (json.dumps({"texts": ["a"] * 9}).encode(), 413, "too_many_sentences"),
        (json.dumps({"text": "a " * 1500}).encode(), 413, "sentence_too_long"),
        (json.dumps({"texts": ["a " * 1900] * 8}).encode(), 413, "request_too_large"),
    ],
)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, status, code):
    response = _post(server, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    _still_serving(server)


def test_attention_endpoint_and_page(server):
    body = {"source": "A man sleeps.", "target": "Ein Mann schläft."}
    attn = httpx.post(f"{server}/v1/attention", json=body, timeout=60).json()
    assert len(attn["encoder"][0][0]) == len(attn["source_pieces"])
    page = httpx.get(f"{server}/", timeout=10)
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert httpx.get(f"{server}/static/app.js", timeout=10).status_code == 200


# -- issue 18: connections time out, and a limit sheds what the server cannot hold ------------


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading and dropping what it sends)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], 0.2)
        if ready:
            try:
                if not sock.recv(65536):
                    return True
            except ConnectionResetError:
                return True
    return False


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _raw_response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the one response the server sends before closing `sock`."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    model = make_model_file(tmp_path_factory.mktemp("tight"))
    flags = ("--idle-timeout", "1", "--header-timeout", "2", "--body-timeout", "2")
    with running_server(model, *flags) as url:
        yield url


def test_an_idle_connection_is_closed_within_the_timeout(tight_server):
    with _connect(tight_server) as sock:  # sends nothing at all
        assert _closed_within(sock, 10)
    with _connect(tight_server) as sock:  # idle after a kept-alive request
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _closed_within(sock, 10)
    _still_serving(tight_server)


def test_a_slowloris_client_is_cut_off(tight_server):
    head = b"POST /v1/translate HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    with _connect(tight_server) as sock:
        start = time.monotonic()
        for byte in head:  # a byte every 0.1 s: never idle, never a complete head
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if _closed_within(sock, 0.1):
                break
        assert time.monotonic() - start < 10, "the trickled head was never cut off"
    _still_serving(tight_server)


def test_a_body_that_does_not_arrive_is_a_json_408(tight_server):
    with _connect(tight_server) as sock:
        head = b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"text": "A')
        status, body = _raw_response(sock)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    _still_serving(tight_server)


def test_beyond_the_connection_limit_503_at_once_while_health_answers(tmp_path_factory):
    from transformer.serving.connections import HEALTH_RESERVE

    model = make_model_file(tmp_path_factory.mktemp("busy"))
    log = tmp_path_factory.mktemp("busy_log") / "serve.log"
    flags = ("--max-connections", "3", "--idle-timeout", "60", "--header-timeout", "60")
    with running_server(model, *flags, log_path=log) as url:
        held = [_connect(url) for _ in range(3)]
        time.sleep(0.5)  # the server has accepted them
        busy = httpx.post(f"{url}/v1/translate", json={"text": "A dog."}, timeout=5)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "overloaded"
        assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"
        # A flood of idle connections: each new one closes the longest-waiting idle one, so
        # the server holds at most 3 + HEALTH_RESERVE and /health still answers. (A refusal
        # when every connection is busy: tests/unit/serving/test_connections.py.)
        held += [_connect(url) for _ in range(3 * HEALTH_RESERVE)]
        assert _closed_within(held[0], 10)
        assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"
        for sock in held:
            sock.close()
        time.sleep(0.5)
        _still_serving(url)
    lines = log.read_text().splitlines()
    evicted = [line for line in lines if "closing the longest-waiting idle connection" in line]
    assert len(evicted) == 1, lines  # one line, not one per evicted connection
