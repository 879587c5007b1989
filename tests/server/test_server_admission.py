"""Admission and access: the bounded queue (503 + Retry-After), the API key, /health while the
model loads, and CORS. Each test runs its own real server process."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server.utils import ServerPreset, ServerProcess, metric_value, running

MODEL = "fake-ds4.gguf"
CHAT = "/v1/chat/completions"
LONG_STREAM = {"messages": [{"role": "user", "content": '!fake {"tokens": 2000, "interval": 0.01}'}], "stream": True}


def test_queue_full_answers_503_with_retry_after():
    # One slot and a queue of one: two requests in flight fill it.
    with ServerProcess(ServerPreset.fake("--max-slots", "1", "--max-queue", "1")) as server:
        server.start()
        with httpx.Client(base_url=server.base, timeout=10) as c1, \
                httpx.Client(base_url=server.base, timeout=10) as c2:
            with c1.stream("POST", CHAT, json=LONG_STREAM) as r1, c2.stream("POST", CHAT, json=LONG_STREAM) as r2:
                assert (r1.status_code, r2.status_code) == (200, 200)
                r3 = server.http.post(CHAT, json={"messages": [{"role": "user", "content": "one more"}]})
                assert r3.status_code == 503
                assert int(r3.headers["retry-after"]) >= 1
                err = r3.json()["error"]
                assert (err["type"], err["code"]) == ("unavailable_error", "queue_full")
                lanes = server.http.get("/v1/lanes").json()
                assert [x["state"] for x in lanes["lanes"]] == ["decode", "queued"]
                assert lanes["queue_len"] == 1
                metrics = server.http.get("/metrics").text
                assert metric_value(metrics, "vllm:num_requests_running") == 1
                assert metric_value(metrics, "vllm:num_requests_waiting") == 1
                assert metric_value(metrics, "ds4:requests_in_flight") == 2
        # Both streams were closed: their requests are cancelled and the queue has room again.
        deadline = time.monotonic() + 3
        while metric_value(server.http.get("/metrics").text, "ds4:requests_in_flight") and time.monotonic() < deadline:
            time.sleep(0.02)
        r = server.http.post(CHAT, json={"messages": [{"role": "user", "content": "room again"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Echo: room again"
        assert len(server.state()["cancelled"]) == 2


@pytest.fixture(scope="module")
def keyed():
    """A server with an API key and CORS, whose model takes a second to load."""
    yield from running(ServerPreset.fake("--api-key", "sekret", "--load-delay", "1.0",
                                         "--cors-origins", "http://app.example,http://other.example"),
                       wait="listening")


def test_health_is_503_while_loading_then_200(keyed):
    r = keyed.http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "loading"
    assert r.json()["error"]["type"] == "unavailable_error"
    r = keyed.http.get("/v1/models")  # public, and known before the model is loaded
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    r = keyed.http.post(CHAT, json={"messages": [{"role": "user", "content": "early"}]},
                        headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and "retry-after" in r.headers
    keyed.wait_for(lambda r: r.status_code == 200, timeout=10)
    assert keyed.http.get("/health").json() == {"status": "ok"}


def test_api_key_required_except_health_and_models(keyed):
    keyed.wait_for(lambda r: r.status_code == 200, timeout=10)
    body = {"messages": [{"role": "user", "content": "auth"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = keyed.http.post(CHAT, json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
    for path in ("/metrics", "/v1/lanes", "/_test/state"):
        assert keyed.http.get(path).status_code == 401
        assert keyed.http.get(path, headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert keyed.http.get("/health").status_code == 200
    assert keyed.http.get("/v1/models").status_code == 200

    good = openai.OpenAI(base_url=keyed.v1(), api_key="sekret", max_retries=0)
    assert good.chat.completions.create(model=MODEL, messages=body["messages"]).choices[0].message.content \
        == "Echo: auth"
    bad = openai.OpenAI(base_url=keyed.v1(), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=body["messages"])


def test_cors_only_for_listed_origins(keyed):
    keyed.wait_for(lambda r: r.status_code == 200, timeout=10)
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = keyed.http.options(CHAT, headers=pre)  # a preflight carries no key and must still pass
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = keyed.http.options(CHAT, headers={**pre, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = keyed.http.get("/health", headers={"Origin": "http://other.example"})
    assert r.headers["access-control-allow-origin"] == "http://other.example"


def test_no_cors_headers_by_default():
    with ServerProcess(ServerPreset.fake()) as server:
        server.start()
        r = server.http.get("/health", headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = server.http.options(CHAT, headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers
