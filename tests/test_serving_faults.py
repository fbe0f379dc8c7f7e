"""The HTTP server under faults and oversized requests (a uvicorn server per test module
over a tiny Llama): a stream whose engine fails ends with an error event instead of hanging,
/health then says the engine failed, bodies past the limit get 413 and a prompt that cannot
fit the context is refused before it is tokenized."""
import json

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from serving_fixtures import running  # noqa: E402

WAIT = 120  # seconds: a guard so a hanging server fails the test instead of hanging it
MAX_LEN = 64
MAX_BODY = 4096
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture
def served():
    """(base url, app): a fresh server (a test may break its engine)."""
    from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
    from jaxgen.serving.http_app import build_app

    model, params = tiny_llama(vocab_size=TINY_VOCAB, max_position_embeddings=MAX_LEN)
    app = build_app(model, params, tiny_tokenizer(chat_template=TEMPLATE), model_name="tiny",
                    slots=2,
                    max_len=MAX_LEN, chunk_size=4, constrained_engines=0,
                    max_body_bytes=MAX_BODY)
    with running(app) as url:
        yield url, app


def _break_engine_after(engine, chunks: int) -> None:
    """The engine's thread raises at its chunk number `chunks` + 1 (a device failure)."""
    advance, calls = engine._advance, [0]

    def broken(*args, **kwargs):
        calls[0] += 1
        if calls[0] > chunks:
            raise RuntimeError("simulated device failure")
        return advance(*args, **kwargs)

    engine._advance = broken


def test_a_stream_whose_engine_fails_ends_with_an_error_event(served):
    url, app = served
    _break_engine_after(app.state.pool.main, chunks=2)
    with httpx.Client(timeout=WAIT) as http:
        with http.stream("POST", url + "/v1/completions", json={
                "prompt": "hi there", "max_tokens": 40, "temperature": 0,
                "stream": True}) as response:
            assert response.status_code == 200
            events = [line[len("data: "):] for line in response.iter_lines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_error" and "simulated device failure" in error["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])  # text came before it
        health = http.get(url + "/health")
        assert health.status_code == 503
        assert health.json()["status"] == "failed"
        assert "simulated device failure" in health.json()["error"]
        refused = http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "engine_failed"


def test_a_body_past_the_limit_gets_413_before_it_is_parsed(served):
    url, _ = served
    big = json.dumps({"prompt": "a" * MAX_BODY, "max_tokens": 2}).encode()
    with httpx.Client(timeout=WAIT) as http:
        declared = http.post(url + "/v1/completions", content=big,
                             headers={"content-type": "application/json"})
        assert declared.status_code == 413, declared.text
        assert declared.json()["error"]["code"] == "request_too_large"
        assert f"at most {MAX_BODY}" in declared.json()["error"]["message"]

        def chunked():  # no Content-Length: refused once the bytes pass the limit
            for start in range(0, len(big), 1000):
                yield big[start:start + 1000]

        streamed = http.post(url + "/v1/completions", content=chunked())
        assert streamed.status_code == 413
        small = http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                         "temperature": 0})
        assert small.status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(served, monkeypatch):
    from jaxgen.serving import http_app

    url, app = served
    per_token = app.state.server.chars_per_token
    assert per_token == 4  # the tiny tokenizer's longest token, "</s>"
    encoded = []
    encode = http_app.encode
    monkeypatch.setattr(http_app, "encode", lambda tok, text, *a, **k: (
        encoded.append(len(text)), encode(tok, text, *a, **k))[1])
    with httpx.Client(timeout=WAIT) as http:
        text = "a" * ((MAX_LEN - 2) * per_token + 1)  # past what 62 tokens can hold
        refused = http.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 2})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert f"{len(text)} characters" in error["message"]
        assert encoded == []  # never tokenized
        chat = http.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": text}], "max_tokens": 2})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        assert "characters" in chat.json()["error"]["message"] and encoded == []
        # within the bound but too many tokens: tokenized, then the usual 400
        counted = http.post(url + "/v1/completions", json={"prompt": "a" * MAX_LEN,
                                                           "max_tokens": 2})
        assert counted.status_code == 400 and encoded == [MAX_LEN]
        assert f"you requested {MAX_LEN + 2} tokens ({MAX_LEN} in the prompt, 2 in the " \
               f"completion)" in counted.json()["error"]["message"]


def test_a_failed_constrained_engine_keeps_the_pool_failed_after_its_eviction(monkeypatch):
    """A failed engine looks idle, so a new schema may evict it: the pool's failure (what
    /health reports) must not clear with it."""
    from jaxgen import GenerationConfig
    from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
    from jaxgen.serving import engine_pool

    monkeypatch.setattr(engine_pool, "Engine", _IdleEngine)
    model, _ = tiny_llama(vocab_size=TINY_VOCAB)
    pool = engine_pool.EnginePool(model, None, tiny_tokenizer(), GenerationConfig(),
                                  constrained_engines=1, slots=4)
    first = {"type": "string", "maxLength": 3}
    pool.submit(first, [1])
    failed = pool._engines[next(iter(pool._engines))]
    failed.failure = RuntimeError("simulated device failure")
    pool.submit({"type": "integer"}, [1])  # evicts the failed (idle) engine
    assert failed.closed and failed not in pool._engines.values()
    assert isinstance(pool.failure, RuntimeError)


class _IdleEngine:
    """An Engine stand-in: accepts every request, runs none, can be marked failed."""

    def __init__(self, *args, slots=4, **kwargs):
        self.slots, self.running, self.waiting = slots, 0, 0
        self.failure, self.closed = None, False

    def submit(self, prompt_ids, **settings):
        return None

    def close(self):
        self.closed = True
