"""serving/server.py: the JSON API, its limits and errors, the batching queue, the page files."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from fixtures import make_model_file, multi30k_lines
from transformer.modelfile import load_model
from transformer.serving.server import (
    ApiError,
    BatchingQueue,
    Options,
    ServeLimits,
    check_attention_size,
    parse_translate,
)

pytest.importorskip("starlette")
pytest.importorskip("httpx2")  # starlette's TestClient (plain httpx is deprecated there)

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
    assert info["parameters"] == load_model(translator.loaded.path).model.num_parameters()
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


# -- issue 18: every request gets a JSON answer; a failure does not take its batch down --------


@pytest.fixture(scope="module")
def wide_client(translator):
    """The default limits: a 256 KB body holds JSON nested 100,000 deep."""
    from starlette.testclient import TestClient

    from transformer.serving.server import create_app

    with TestClient(create_app(translator)) as c:
        yield c


_DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("body", "status", "code", "needle"),
    [
        (b'{"text": "A dog.", "n_best": 8}', 422, "invalid_option", "n_best=8 must be <= beam"),
        (b'{"text": "A dog.", "n_best": 3}', 200, None, None),  # <= the model's beam of 4
        (b'{"text": "\\ud800"}', 422, "invalid_text", "sentence 0: character 0 is a lone"),
        (b'{"texts": ["A dog.", "a\\udc80b"]}', 422, "invalid_text", "sentence 1: character 1"),
        (_DEEP, 400, "malformed_json", "nested too deeply"),
        (b'{"text": ' + _DEEP + b"}", 400, "malformed_json", "nested too deeply"),
        (b'{"text": "a", "beam_size": ' + b"7" * 5000 + b"}", 400, "malformed_json", "digits"),
        (b'{"text": "a", "beam_size": ' + b"7" * 4000 + b"}", 422, "invalid_option", "beam_size"),
        (b'{"text": "a", "length_penalty": NaN}', 422, "invalid_option", "length_penalty"),
        (b'{"text": "a", "length_penalty": Infinity}', 422, "invalid_option", "length_penalty"),
        (b'{"text": "a", "length_penalty": -1}', 422, "invalid_option", "length_penalty"),
        (b'{"text": "a", "length_penalty": 1e999}', 422, "invalid_option", "length_penalty"),
        (b'{"\\ud800": 1, "text": "a"}', 422, "unknown_option", "'\\ud800'"),
    ],
)
def test_adversarial_requests_get_json_with_the_right_code(wide_client, body, status, code, needle):
    response = wide_client.post(
        "/v1/translate", content=body, headers={"content-type": "application/json"}
    )
    if code is None:
        assert response.status_code == status, response.text
    else:
        assert needle in _error(response, status, code)
    assert wide_client.post("/v1/translate", json={"text": "A dog."}).status_code == 200


@pytest.mark.parametrize(
    "body",
    [b'{"source": "\\ud800"}', b'{"source": "A dog.", "target": "Ein \\udfff"}', _DEEP],
)
def test_attention_endpoint_refuses_what_text_cannot_hold(wide_client, body):
    response = wide_client.post("/v1/attention", content=body)
    assert response.status_code in (400, 422), response.text
    assert response.json()["error"]["code"] in ("invalid_text", "malformed_json")


class _Failing:
    """The translator, except that decoding any batch that holds "boom" raises."""

    def __init__(self, translator):
        self._translator, self.calls = translator, []

    def __getattr__(self, name):
        return getattr(self._translator, name)

    def translate(self, lines, *args):
        self.calls.append(list(lines))
        if "boom" in lines:
            raise RuntimeError("a bug in the search")
        return self._translator.translate(lines, *args)


def test_an_unexpected_failure_is_a_json_500_and_its_batch_mates_are_answered(translator):
    from concurrent.futures import ThreadPoolExecutor

    from starlette.testclient import TestClient

    from transformer.serving.server import create_app

    failing = _Failing(translator)
    good = multi30k_lines("test_2016_flickr", "en", 2)
    with TestClient(create_app(failing, ServeLimits(batch_wait_ms=500))) as c:
        with ThreadPoolExecutor(3) as pool:
            bodies = [{"text": "boom"}, {"text": good[0]}, {"texts": good}]
            responses = list(pool.map(lambda b: c.post("/v1/translate", json=b), bodies))
        health = c.get("/health").json()
    assert "a bug" not in _error(responses[0], 500, "internal_error")
    assert sorted(failing.calls[0]) == sorted(["boom", good[0], *good])  # they shared a batch
    expected = [n[0].text for n in translator.translate(good)]
    assert responses[1].status_code == 200, responses[1].text
    assert responses[1].json()["results"][0]["translations"][0]["text"] == expected[0]
    assert [r["translations"][0]["text"] for r in responses[2].json()["results"]] == expected
    assert health["errors"] == 1


def test_queue_answers_the_other_requests_of_a_failed_batch():
    def run(lines, options):  # noqa: ARG001
        if "bad" in lines:
            raise RuntimeError("boom")
        return [line.upper() for line in lines]

    async def main():
        queue = BatchingQueue(run, wait_s=0.05, max_sentences=64)
        queue.start()
        results = await asyncio.gather(
            queue.submit(["a", "b"], Options()),
            queue.submit(["bad"], Options()),
            queue.submit(["c"], Options()),
            return_exceptions=True,
        )
        await queue.stop()
        return results, queue.stats

    results, stats = asyncio.run(main())
    assert results[0] == ["A", "B"] and results[2] == ["C"]
    assert isinstance(results[1], RuntimeError)
    assert (stats.batches, stats.errors) == (1, 1)


def test_attention_size_is_counted_per_layer_head_and_side():
    # N=2, H=4, S=3, T=2: 8 * (3*3 + 2*2 + 2*3) = 152 weights.
    check_attention_size([(3, 2)], n_layers=2, n_heads=4, limit=152)
    with pytest.raises(ApiError, match="152 > limit 151") as e:
        check_attention_size([(3, 2)], n_layers=2, n_heads=4, limit=151)
    assert e.value.status == 413


def test_attention_answers_are_bounded(translator):
    from starlette.testclient import TestClient

    from transformer.serving.server import create_app

    lines = multi30k_lines("test_2016_flickr", "en", 4)
    with TestClient(create_app(translator, ServeLimits(max_attention_weights=20_000))) as c:
        one = c.post("/v1/translate", json={"text": "A dog.", "attention": True})
        assert one.status_code == 200 and "attention" in one.json()["results"][0]
        many = c.post("/v1/translate", json={"texts": lines, "attention": True})
        message = _error(many, 413, "attention_too_large")
        assert "for these 4 sentences" in message and "> limit 20,000" in message
        assert c.post("/v1/translate", json={"texts": lines}).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"), [("max_connections", 0), ("idle_timeout_s", -1.0), ("body_timeout_s", 0)]
)
def test_serve_limits_must_be_positive(field, value):
    from transformer.errors import UserError

    with pytest.raises(UserError, match=f"serve: {field} must be a positive number"):
        ServeLimits(**{field: value})


def test_serve_checks_the_model_file_unless_no_verify(
    tiny_model_file, tmp_path, monkeypatch, capsys
):
    import uvicorn

    from transformer.cli import main

    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(tiny_model_file.read_bytes())
    data[-3] ^= 0x01  # one flipped bit in the tensor data
    damaged.write_bytes(bytes(data))
    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw["port"]))
    assert main(["serve", str(damaged), "--port", "8123"]) == 2
    assert "the tensor data does not match" in capsys.readouterr().err and not served
    assert main(["serve", str(damaged), "--port", "8123", "--no-verify"]) == 0
    assert served == [8123]


@pytest.mark.parametrize(
    ("flags", "env", "tuned"),
    [([], {}, True), ([], {"OMP_NUM_THREADS": "1"}, False), (["--threads", "1"], {}, False)],
)
def test_serve_tunes_its_threads_unless_told(tmp_path, monkeypatch, flags, env, tuned):
    """`transformer serve` decodes with `--threads auto` by default, as translate does: with
    torch's every-core default, the clients on the same cores (or any busy process) made each
    op wait for a thread that was not running (78.6 req/s against 135 with one thread, 16
    clients on 2 cores). OMP_NUM_THREADS or --threads N fix the count instead."""
    import uvicorn

    from transformer.cli import main
    from transformer.translate import Translator

    made = []
    real = Translator.from_path.__func__

    def spy(cls, *args, **kwargs):
        made.append(real(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(Translator, "from_path", classmethod(spy))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    try:
        model = make_model_file(tmp_path / "m")
        assert main(["serve", str(model), "--port", "0", *flags]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (made[0].tuner is not None) is tuned


def test_serve_builds_the_model_on_the_thread_that_decodes(tmp_path, monkeypatch):
    """Torch work on two Python threads makes two OpenMP teams, and GNU OpenMP then throttles
    every spin-wait (`server.decode_thread`): `serve` loads and decodes on one thread."""
    import threading

    import uvicorn
    from starlette.testclient import TestClient

    from transformer.serving import server
    from transformer.translate import Translator

    built, decoded = [], []
    real_from_path, real_translate = Translator.from_path.__func__, Translator.translate

    def from_path(cls, *args, **kwargs):
        built.append(threading.get_ident())
        return real_from_path(cls, *args, **kwargs)

    def translate(self, *args, **kwargs):
        decoded.append(threading.get_ident())
        return real_translate(self, *args, **kwargs)

    def run(app, **kwargs):
        with TestClient(app) as c:
            for text in multi30k_lines("test_2016_flickr", "en", 2):
                response = c.post("/v1/translate", json={"texts": [text]})
                assert response.status_code == 200, response.text

    monkeypatch.setattr(Translator, "from_path", classmethod(from_path))
    monkeypatch.setattr(Translator, "translate", translate)
    monkeypatch.setattr(uvicorn, "run", run)
    server.serve(make_model_file(tmp_path), threads=None)
    assert len(built) == 1 and len(decoded) == 2
    assert set(decoded) == set(built) and built[0] != threading.get_ident()


def test_serve_reports_a_model_that_fails_to_load(tmp_path):
    from transformer.errors import UserError
    from transformer.serving import server

    (tmp_path / "bad.safetensors").write_bytes(b"not a model")
    with pytest.raises(UserError, match="bad.safetensors"):
        server.serve(tmp_path / "bad.safetensors")
