"""Who may call the server and by which names: the API key (Bearer or x-api-key, every API's
own error shape), open /health and /metrics, served-model aliases, CORS, and /tokenize and
/detokenize, on an in-process app (the tokenizers package is the oracle of the token ids)."""

import json

import pytest

pytest.importorskip("flask")
pytest.importorskip("prometheus_client")

from kipp.engine.scheduler import Scheduler  # noqa: E402
from kipp.http.access import Access  # noqa: E402
from kipp.http.app import create_app  # noqa: E402
from kipp.model import load  # noqa: E402
from kipp.text.chat import render  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
KEY = "s3cret-key"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(artifacts):
    return load(artifacts(TINY), backend="reference", kv_tokens=4096, progress=False)


@pytest.fixture(scope="module")
def scheduler(model):
    s = Scheduler(model).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def locked(model, scheduler):
    app = create_app(model, scheduler, served_names=("qwen3", TINY),
                     access=Access(api_key=KEY, cors_origins=("http://localhost:3000",)))
    return app.test_client()


def chat(client, headers=None, model=TINY, path="/v1/chat/completions"):
    return client.post(path, json={"model": model, "messages": HI, "max_tokens": 2},
                       headers=headers or {})


@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}])
def test_the_key_opens_every_api(locked, headers):
    assert chat(locked, headers).status_code == 200
    r = locked.post("/v1/messages", headers=headers, json={
        "model": TINY, "max_tokens": 2, "messages": HI})
    assert r.status_code == 200 and r.json["type"] == "message"
    r = locked.post("/v1/responses", headers=headers, json={
        "model": "qwen3", "input": "hi", "max_output_tokens": 2})
    assert r.status_code == 200 and r.json["object"] == "response"


@pytest.mark.parametrize("headers, code", [
    ({}, "missing_api_key"), ({"Authorization": "Bearer nope"}, "invalid_api_key"),
    ({"x-api-key": KEY[:-1]}, "invalid_api_key"), ({"Authorization": KEY}, "missing_api_key")])
def test_a_missing_or_wrong_key_is_a_401_in_each_api_shape(locked, headers, code):
    r = chat(locked, headers)
    assert r.status_code == 401 and r.json["error"]["code"] == code
    r = locked.post("/v1/messages", headers=headers,
                    json={"model": TINY, "max_tokens": 2, "messages": HI})
    assert r.status_code == 401
    assert r.json["type"] == "error" and r.json["error"]["type"] == "authentication_error"
    r = locked.post("/tokenize", headers=headers, json={"content": "hi"})
    assert r.status_code == 401


def test_health_and_metrics_stay_open_unless_protected(model, scheduler, locked):
    assert locked.get("/health").status_code == 200
    assert locked.get("/metrics").status_code == 200
    closed = create_app(model, scheduler, access=Access(api_key=KEY, protect_info=True))
    client = closed.test_client()
    assert client.get("/health").status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.get("/health", headers={"x-api-key": KEY}).status_code == 200


def test_served_names_are_aliases_and_others_get_a_404_listing_them(locked):
    key = {"x-api-key": KEY}
    names = [m["id"] for m in locked.get("/v1/models", headers=key).json["data"]]
    assert names == ["qwen3", TINY]
    r = chat(locked, key, model="qwen3")
    assert r.status_code == 200 and r.json["model"] == "qwen3"  # the first name is reported
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = locked.post(path, headers=key, json={"model": "gpt-4o", "max_tokens": 2,
                                                 "messages": HI})
        assert r.status_code == 404
        text = json.dumps(r.json)
        assert "'qwen3'" in text and f"'{TINY}'" in text and "gpt-4o" in text


def test_cors_is_off_by_default_and_answers_the_listed_origins(model, scheduler, locked):
    origin = {"Origin": "http://localhost:3000"}
    r = locked.options("/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, x-api-key"})
    assert r.status_code == 204
    assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == "content-type, x-api-key"
    r = chat(locked, {**origin, "x-api-key": KEY})
    assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    r = chat(locked, {"Origin": "http://evil.example", "x-api-key": KEY})
    assert "Access-Control-Allow-Origin" not in r.headers
    plain = create_app(model, scheduler).test_client()
    r = chat(plain, origin)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers


def test_tokenize_and_detokenize_agree_with_the_tokenizers_package(model, scheduler):
    tokenizers = pytest.importorskip("tokenizers")
    from kipp.text.tokenizer_files import tokenizer_json_bytes

    oracle = tokenizers.Tokenizer.from_str(tokenizer_json_bytes().decode())
    client = create_app(model, scheduler).test_client()
    text = "Kipp serves agents: <think> tags, ünïcode and 12345."
    r = client.post("/tokenize", json={"content": text, "with_pieces": True})
    assert r.status_code == 200
    assert r.json["tokens"] == oracle.encode(text, add_special_tokens=False).ids
    assert r.json["count"] == len(r.json["tokens"]) and len(r.json["pieces"]) == r.json["count"]
    assert r.json["max_model_len"] == model.entry.context_length
    r = client.post("/detokenize", json={"tokens": r.json["tokens"]})
    assert r.status_code == 200 and r.json["content"] == text
    r = client.post("/tokenize", json={"messages": HI, "model": TINY})
    expected = oracle.encode(render(HI), add_special_tokens=False).ids
    assert r.json["tokens"] == expected


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": "a", "prompt": "b"}, "prompt"),
    ("/tokenize", {"content": 3}, "content"),
    ("/tokenize", {"content": "a", "model": "other"}, "model"),
    ("/tokenize", {"content": "a", "extra": 1}, "extra"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**7]}, "tokens"),
])
def test_bad_token_requests_name_the_field(model, scheduler, path, body, param):
    client = create_app(model, scheduler).test_client()
    r = client.post(path, json=body)
    assert 400 <= r.status_code < 500 and r.json["error"]["param"] == param
