"""`jaxgen serve`'s HTTP app (jaxgen.serving.http_app) through the real `openai` client: a
uvicorn server on 127.0.0.1 in a background thread, over a tiny Llama and the tiny byte-level
tokenizer. Greedy answers equal solo generate_ids calls, sampled ones the solo call with the
same key; stop strings cut the text; schemas hold; errors are OpenAI's objects."""
import concurrent.futures
import json
import math
import threading
import time

import jax
import numpy as np
import pytest

import jaxgen

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from serving_fixtures import running  # noqa: E402

WAIT = 300  # seconds: a bound so a broken server fails the test instead of hanging it
MAX_LEN = 256
EOS = 256  # tiny_tokenizer's "</s>"
HELD_AT = 64  # new tokens at which the disconnect test holds its row (see there)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def served():
    """(base url, app, model, params, tokenizer): the server runs for the module."""
    from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
    from jaxgen.serving.http_app import build_app

    model, params = tiny_llama(vocab_size=TINY_VOCAB)
    tokenizer = tiny_tokenizer(chat_template=TEMPLATE)
    app = build_app(model, params, tokenizer, model_name="tiny", slots=4, max_len=MAX_LEN,
                    chunk_size=4, max_waiting=64, max_top_logprobs=3, constrained_engines=1,
                    constrained_slots=2)
    with running(app) as url:
        yield url, app, model, params, tokenizer
    assert app.state.pool.closed  # the lifespan's shutdown closed the engines


def _client(url, **options):
    return openai.OpenAI(base_url=url + "/v1", api_key=options.pop("api_key", "none"),
                         max_retries=0, timeout=WAIT, **options)


def _solo_text(served, prompt_ids, max_new, **settings):
    _, _, model, params, tokenizer = served
    seed = settings.pop("seed_key", None)
    cfg = jaxgen.GenerationConfig(max_new_tokens=max_new, eos_token_id=EOS, **settings)
    keys = {} if seed is None else {"key": jax.random.key(seed)}
    row = jaxgen.generate_ids(model, params, [prompt_ids], cfg, **keys)[0]
    return tokenizer.decode(row[len(prompt_ids):], skip_special_tokens=True)


def _chat_ids(served, text):
    tokenizer = served[4]
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_models_chat_and_streaming_equal_the_solo_greedy_answer(served):
    url = served[0]
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    expected = _solo_text(served, _chat_ids(served, "Hi there"), 12)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=12,
        temperature=0)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens == len(_chat_ids(served, "Hi there"))
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in _client(url).completions.create(
        model="tiny", prompt="Hi there", max_tokens=9, temperature=0, stream=True))
    assert streamed == _solo_text(served, served[4].encode("Hi there"), 9)
    raw = httpx.post(url + "/v1/completions", timeout=WAIT, json={
        "prompt": "Hi", "max_tokens": 3, "stream": True})
    events = [line for line in raw.text.split("\n\n") if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_n_sampled_choices_equal_their_solo_sampled_calls(served):
    client = _client(served[0])
    reply = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=10, n=3,
                                      seed=11, temperature=0.9)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    expected = [_solo_text(served, [5, 6, 7, 8], 10, do_sample=True, temperature=0.9,
                           top_k=0, seed_key=11 + j) for j in range(3)]
    assert [c.text for c in reply.choices] == expected
    assert len(set(expected)) > 1  # the keys differ per choice


def test_stop_strings_cut_the_text_before_the_stop(served):
    client = _client(served[0])
    full = client.completions.create(model="tiny", prompt="hello", max_tokens=40,
                                     temperature=0).choices[0].text
    start = next(i for i in range(2, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]  # two whole characters past the answer's start
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=40,
                                      temperature=0, stop=[stop, "never-there"])
    assert reply.choices[0].text == full[:full.find(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_json_schema_output_is_valid_against_the_schema(served):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    reply = _client(served[0]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json"}], max_tokens=60, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_log_probs_are_the_engines_per_token_distribution(served):
    client = _client(served[0])
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8, seed=3,
        temperature=1.0, logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert 1 <= len(entries) <= 8
    for entry in entries:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert sum(math.exp(v) for v in tops) <= 1 + 1e-5
        assert entry.logprob <= tops[0] + 1e-6
        if entry.token == entry.top_logprobs[0].token:
            assert entry.logprob == pytest.approx(tops[0], abs=1e-5)
    greedy = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0,
                                       logprobs=2)
    # a temperature-0 row keeps only its argmax: log-prob 0, the others OpenAI's floor
    assert greedy.choices[0].logprobs.token_logprobs == [0.0] * 4
    assert all(sorted(top.values()) == [-9999.0, 0.0]
               for top in greedy.choices[0].logprobs.top_logprobs)


def test_a_client_that_disconnects_frees_its_slot(served):
    """A streaming client that leaves mid-answer: its request ends "cancelled" with the tokens
    so far, and its slot frees. Once the row holds HELD_AT new tokens of its 252, the engine
    waits at that chunk boundary until the server has asked to cancel the request, so the row
    is still running when the client leaves, however fast the engine decodes."""
    url, app = served[0], served[1]
    engine = app.state.pool.main
    handles = []
    submit = app.state.pool.submit
    advance = engine._advance
    resume = threading.Event()
    prompt = [1, 2, 3]

    def held_advance(*args, **kwargs):
        ours = [slot for slot, request in enumerate(engine._running)
                if request is not None and handles and request.handle is handles[0]]
        if ours and engine._sent[ours[0]] - len(prompt) >= HELD_AT:
            resume.wait(WAIT)
        return advance(*args, **kwargs)

    app.state.pool.submit = lambda *a, **k: handles.append(submit(*a, **k)) or handles[-1]
    engine._advance = held_advance
    try:
        with httpx.Client(timeout=WAIT) as http:
            with http.stream("POST", url + "/v1/completions", json={
                    "prompt": prompt, "max_tokens": MAX_LEN - 4, "stream": True,
                    "temperature": 0}) as response:
                lines = response.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
                assert engine.running == 1  # held before its answer's end
                response.close()  # the client leaves
        deadline = time.monotonic() + WAIT
        while not handles[0].cancel_requested and time.monotonic() < deadline:
            time.sleep(0.02)
        assert handles[0].cancel_requested
    finally:
        resume.set()
        del engine._advance  # the class's own again
        app.state.pool.submit = submit
    completion = handles[0].result(timeout=WAIT)
    assert completion.status == "cancelled"
    assert 0 < len(completion.new_ids) < MAX_LEN - 4
    deadline = time.monotonic() + WAIT
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.running == 0


def test_bad_requests_get_openai_error_objects(served):
    url = served[0]
    client = _client(url)
    raw = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=WAIT)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                       extra_body={"frobnicate": 1})
    assert unknown.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as wrong_type:
        client.completions.create(model="tiny", prompt="a", temperature="hot")
    assert wrong_type.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert unsupported.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=MAX_LEN)
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert f"{MAX_LEN} tokens" in too_long.value.body["message"]
    assert f"{MAX_LEN + 3} tokens (3 in the prompt, {MAX_LEN} in the completion)" \
        in too_long.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="a", max_tokens=2)


def test_an_api_key_is_required_when_set(served):
    url, app = served[0], served[1]
    app.state.server.api_key = "sesame"
    try:
        with pytest.raises(openai.AuthenticationError) as refused:
            _client(url, api_key="wrong").models.list()
        assert refused.value.status_code == 401
        assert httpx.get(url + "/v1/models", timeout=WAIT).status_code == 401
        assert _client(url, api_key="sesame").models.list().data[0].id == "tiny"
    finally:
        app.state.server.api_key = None


def test_a_full_queue_answers_429(served):
    url, app = served[0], served[1]
    engine = app.state.pool.main
    bound = engine.max_waiting
    with httpx.Client(timeout=WAIT) as http:
        with engine._device:  # nothing is admitted meanwhile
            engine.max_waiting = 1
            try:
                with http.stream("POST", url + "/v1/completions", json={
                        "prompt": "a", "max_tokens": 2, "stream": True}) as waiting:
                    assert waiting.status_code == 200
                    with pytest.raises(openai.RateLimitError) as full:
                        _client(url).completions.create(model="tiny", prompt="b", max_tokens=2)
                    assert full.value.body["code"] == "queue_full"
            finally:
                engine.max_waiting = bound


def _mixed_requests(count, seed):
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, 255, size=int(rng.integers(2, 21))).tolist(),
             int(rng.integers(2, 31))) for _ in range(count)]


def _greedy_parity(served, count):
    client = _client(served[0])
    requests = _mixed_requests(count, seed=count)

    def ask(request):
        prompt, budget = request
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=budget,
                                         temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        texts = list(pool.map(ask, requests))
    assert texts == [_solo_text(served, p, n) for p, n in requests]


def test_sixteen_concurrent_greedy_requests_equal_solo_calls(served):
    _greedy_parity(served, 16)


@pytest.mark.slow
def test_sixty_four_concurrent_greedy_requests_equal_solo_calls(served):
    _greedy_parity(served, 64)
