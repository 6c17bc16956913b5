"""serving/server.py: the JSON API, its limits and errors, the batching queue, the page files."""

from __future__ import annotations

import asyncio
import json

import pytest

from fixtures import make_model_file, multi30k_lines
from transformer.serving.server import (
    ApiError,
    BatchingQueue,
    Options,
    ServeLimits,
    parse_translate,
)

pytest.importorskip("starlette")
pytest.importorskip("httpx")

LIMITS = ServeLimits(max_sentences=4, max_sentence_chars=300, max_request_bytes=4000)


@pytest.fixture(scope="module")
def translator(tmp_path_factory):
    from transformer.translate import Translator

    return Translator.from_path(make_model_file(tmp_path_factory.mktemp("serve")))


@pytest.fixture(scope="module")
def client(translator):
    from starlette.testclient import TestClient

    from transformer.serving.server import create_app

    with TestClient(create_app(translator, LIMITS)) as c:
        yield c


def _error(response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == code
    return body["message"]


def test_health_and_model_info(client, translator):
    assert client.get("/health").json()["status"] == "ok"
    info = client.get("/v1/model").json()
    assert (info["src_lang"], info["tgt_lang"]) == ("en", "de")
    assert info["model"]["d_model"] == 32
    assert info["parameters"] == translator.loaded.model.num_parameters()
    assert info["limits"]["max_sentences"] == 4


def test_translate_equals_the_translator(client, translator):
    lines = multi30k_lines("test_2016_flickr", "en", 3)
    response = client.post("/v1/translate", json={"texts": lines, "beam_size": 2})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    expected = translator.translate(lines, beam_size=2)
    assert [r["source"] for r in results] == lines
    for result, nbest in zip(results, expected, strict=True):
        assert [t["text"] for t in result["translations"]] == [t.text for t in nbest]
        assert [t["tokens"] for t in result["translations"]] == [t.tokens for t in nbest]


def test_n_best_and_single_text(client):
    response = client.post(
        "/v1/translate", json={"text": "A dog runs.", "beam_size": 3, "n_best": 3}
    )
    translations = response.json()["results"][0]["translations"]
    assert len(translations) == 3
    scores = [t["score"] for t in translations]
    assert scores == sorted(scores, reverse=True)


def test_translate_with_attention_has_per_layer_head_shapes(client):
    response = client.post("/v1/translate", json={"text": "A dog runs.", "attention": True})
    attn = response.json()["results"][0]["attention"]
    S, T = len(attn["source_pieces"]), len(attn["target_pieces"])
    assert len(attn["cross"]) == 2 and len(attn["cross"][0]) == 4  # N layers, H heads
    assert [len(attn["cross"][1][3]), len(attn["cross"][1][3][0])] == [T, S]
    assert len(attn["encoder"][0][0]) == S and len(attn["decoder"][0][0][0]) == T
    for row in attn["encoder"][1][2]:
        assert sum(row) == pytest.approx(1.0, abs=1e-3)  # softmax rows (rounded to 4 places)


def test_attention_endpoint_with_given_target(client):
    body = {"source": "A man sleeps.", "target": "Ein Mann schläft."}
    attn = client.post("/v1/attention", json=body).json()
    assert attn["translation"] == "Ein Mann schläft."
    assert attn["source_pieces"][-1] == "</s>" and attn["target_input_pieces"][0] == "<s>"
    assert len(attn["cross"][0][0]) == len(attn["target_pieces"])


@pytest.mark.parametrize(
    ("body", "status", "code", "needle"),
    [
        (b"{not json", 400, "malformed_json", "not valid JSON"),
        (b"[1, 2]", 422, "invalid_request", "JSON object"),
        (b'{"texts": []}', 422, "empty_input", "empty"),
        (b'{"text": "   "}', 422, "empty_input", "empty"),
        (b'{"text": "a", "beam": 4}', 422, "unknown_option", "'beam'"),
        (b'{"text": "a", "texts": ["b"]}', 422, "invalid_request", "exactly one"),
        (b'{"texts": "a"}', 422, "invalid_request", "list"),
        (b'{"text": "a", "beam_size": 0}', 422, "invalid_option", "beam_size"),
        (b'{"text": "a", "beam_size": 99}', 422, "invalid_option", "beam_size"),
        (b'{"text": "a", "beam_size": 2, "n_best": 3}', 422, "invalid_option", "n_best=3"),
        (b'{"text": "a", "length_penalty": "x"}', 422, "invalid_option", "length_penalty"),
        (b'{"texts": ["a", "b", "c", "d", "e"]}', 413, "too_many_sentences", "5 sentences"),
        (json.dumps({"text": "x" * 301}).encode(), 413, "sentence_too_long", "301 characters"),
        (json.dumps({"text": "ab " * 1400}).encode(), 413, "request_too_large", "4000 bytes"),
    ],
)
def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(
    client, body, status, code, needle
):
    response = client.post(
        "/v1/translate", content=body, headers={"content-type": "application/json"}
    )
    assert needle in _error(response, status, code)
    assert client.post("/v1/translate", json={"text": "A dog."}).status_code == 200


def test_too_many_subword_tokens_is_413(translator):
    from starlette.testclient import TestClient

    from transformer.serving.server import create_app

    limits = ServeLimits(max_sentence_tokens=5)
    with TestClient(create_app(translator, limits)) as c:
        message = _error(
            c.post("/v1/translate", json={"texts": ["ok", "a b c d e f g"]}),
            413,
            "sentence_too_long",
        )
    assert message.startswith("sentence 1:") and "subword tokens > 5" in message


def test_attention_limits_and_errors(client):
    _error(client.post("/v1/attention", json={"source": ""}), 422, "empty_input")
    _error(client.post("/v1/attention", json={"source": "a", "x": 1}), 422, "unknown_option")
    long = " ".join(["word"] * 150)  # > max_attention_tokens (100) subword tokens
    _error(client.post("/v1/attention", json={"source": long}), 413, "sentence_too_long")


def test_unknown_route_and_method_are_json_errors(client):
    _error(client.get("/v1/nothing"), 404, "not_found")
    _error(client.get("/v1/translate"), 405, "method_not_allowed")


def test_page_and_static_files_are_served_locally(client):
    page = client.get("/")
    assert page.status_code == 200 and 'id="translate"' in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # no CDN: every asset is local
    assert 'api("/v1/translate"' in client.get("/static/app.js").text
    assert client.get("/static/style.css").status_code == 200


def test_parse_translate_defaults_and_options():
    texts, options, attention = parse_translate({"text": "a"}, ServeLimits())
    assert (texts, options, attention) == (["a"], Options(), False)
    _, options, _ = parse_translate({"texts": ["a"], "length_penalty": 1}, ServeLimits())
    assert options.length_penalty == 1.0
    with pytest.raises(ApiError, match="n_best"):
        parse_translate({"text": "a", "n_best": True}, ServeLimits())


def test_queue_gathers_concurrent_requests_into_one_batch():
    calls = []

    def run(lines, options):
        calls.append((list(lines), options))
        return [f"<{line}>" for line in lines]

    async def main():
        queue = BatchingQueue(run, wait_s=0.05, max_sentences=64)
        queue.start()
        requests = [queue.submit([f"s{i}a", f"s{i}b"], Options()) for i in range(5)]
        requests.append(queue.submit(["beam"], Options(beam_size=2)))
        results = await asyncio.gather(*requests)
        await queue.stop()
        return results, queue.stats

    results, stats = asyncio.run(main())
    assert results[3] == ["<s3a>", "<s3b>"] and results[5] == ["<beam>"]
    # One batch for the 5 default-option requests, one for the beam-2 request.
    assert sorted(len(lines) for lines, _ in calls) == [1, 10]
    assert (stats.batches, stats.sentences, stats.largest_batch, stats.pending) == (2, 11, 10, 0)


def test_queue_respects_max_sentences_and_reports_failures():
    def run(lines, options):  # noqa: ARG001
        if "bad" in lines:
            raise RuntimeError("boom")
        return lines

    async def main():
        queue = BatchingQueue(run, wait_s=0.05, max_sentences=2, max_pending=5)
        queue.start()
        ok = [queue.submit([str(i)], Options()) for i in range(4)]
        results = await asyncio.gather(*ok)
        with pytest.raises(RuntimeError, match="boom"):
            await queue.submit(["bad"], Options())
        with pytest.raises(ApiError, match="more than 5"):
            await queue.submit(["x"] * 6, Options())
        await queue.stop()
        return results, queue.stats

    results, stats = asyncio.run(main())
    assert results == [["0"], ["1"], ["2"], ["3"]]
    assert stats.largest_batch == 2 and stats.errors == 1


def test_cli_serve_with_a_missing_model_is_a_clean_error(tmp_path, capsys):
    from transformer.cli import main

    assert main(["serve", str(tmp_path / "missing.safetensors"), "--port", "1"]) == 2
    assert "no such model file" in capsys.readouterr().err
