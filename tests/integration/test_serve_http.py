"""`transformer serve` as a real server on 127.0.0.1, driven by a real HTTP client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from fixtures import make_model_file, multi30k_lines, running_server

httpx = pytest.importorskip("httpx")
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
