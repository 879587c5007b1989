"""The shipped command on the real engine: ``ds4-app --serve --model tiny.gguf --backend cpu``.

- concurrency is exact: eight clients at once get exactly the text each gets alone (greedy, and
  sampled with a seed);
- a load of 200 requests, some abandoned mid-stream, leaves no page, slot or queue entry behind.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import httpx
import openai
import pytest

from tests.server.utils import ServerPreset, running

pytest.importorskip("ds4_app.engine._native", reason="needs the native engine (make install)")

PROMPTS = [f"Tell me about item {i}: {'abc' * (i + 1)}" for i in range(8)]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    yield from running(ServerPreset.embedded(tiny_model_path, "--max-slots", "8", "--max-queue", "64"),
                       timeout=60)


def ask(base: str, prompt: str, *, stream: bool, **kw) -> str:
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
    args = dict(model="tiny.gguf", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                extra_body={"ignore_eos": True}, **kw)
    if not stream:
        m = client.chat.completions.create(**args).choices[0].message
        return (m.model_extra or {}).get("reasoning_content", "") + "|" + (m.content or "")
    parts = {"r": "", "c": ""}
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            d = chunk.choices[0].delta
            parts["c"] += d.content or ""
            parts["r"] += (d.model_extra or {}).get("reasoning_content") or ""
    return parts["r"] + "|" + parts["c"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_eight_concurrent_clients_get_their_solo_text(server, sampling):
    solo = [ask(server.v1(), p, stream=False, **sampling) for p in PROMPTS]
    assert len(set(solo)) > 1  # the prompts really lead to different replies
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: ask(server.v1(), PROMPTS[i], stream=i % 2 == 0, **sampling), range(8)))
    assert together == solo


def test_200_requests_leave_nothing_behind(server):
    rng = random.Random(0)
    bodies = [{"messages": [{"role": "user", "content": f"load {i} " + "x" * rng.randrange(1, 8)}],
               "max_tokens": rng.randrange(1, 6), "stream": i % 3 != 0} for i in range(200)]

    def one(c: httpx.Client, i: int) -> str:
        body = bodies[i]
        if not body["stream"]:
            return str(c.post("/v1/chat/completions", json=body).status_code)
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for n, line in enumerate(r.iter_lines()):
                if i % 7 == 0 and n >= 1:
                    return "abandoned"  # leave mid-stream: the server must cancel it
                if line == "data: [DONE]":
                    return "200"
        return "cut"

    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
    with httpx.Client(base_url=server.base, timeout=60, limits=limits) as c, \
            concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(lambda i: one(c, i), range(200)))
    assert set(outcomes) <= {"200", "abandoned"}, outcomes
    assert outcomes.count("200") >= 150

    lanes = server.http.get("/v1/lanes").json()
    for _ in range(100):  # cancellations land within a step or two
        if not lanes["lanes"] and lanes["n_running"] == 0:
            break
        lanes = server.http.get("/v1/lanes").json()
    assert lanes["lanes"] == [] and lanes["queue_len"] == 0 and lanes["n_running"] == 0
    pool = lanes["pool"]
    assert (pool["used"], pool["reserved"], pool["free"]) == (0, 0, pool["n_pages"]), json.dumps(pool)
    metrics = server.http.get("/metrics").text
    assert "ds4:requests_in_flight{model_name=\"tiny.gguf\"} 0.0" in metrics
