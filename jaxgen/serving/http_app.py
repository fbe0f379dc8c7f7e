"""An OpenAI-compatible HTTP server over the continuous-batching engines (ASGI, Starlette).

Endpoints: `POST /v1/chat/completions` (the tokenizer's chat template), `POST
/v1/completions`, `GET /v1/models`, `GET /health`. Streaming answers are server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`.

Why Starlette (and uvicorn to run it), not FastAPI: every request body is checked here by
jaxgen.serving.openai_schema to produce OpenAI's own error objects (400 with `param` naming
the field), so FastAPI's pydantic models and its 422 validation errors would add a layer to
undo; Starlette is FastAPI's own small, well-kept base (routing, streaming responses,
lifespan), and uvicorn its usual server.

How requests map to the engines (jaxgen.serving.engine_pool): one sampling engine
(do_sample=True; temperature 1, top_p 1 by default, as OpenAI) serves every free-text request;
`temperature: 0` runs that request's row greedily (top_k = 1 for its row: the argmax, equal
to a solo greedy jaxgen.generate_ids). `n` submits n requests (seed s: choice j samples with
jax.random.key(s + j)). `stop` strings are matched on the decoded text as tokens stream
(jaxgen.serving.detokenize); at a stop the request is cancelled and the text cut before it.
`logprobs` / `top_logprobs` are the engine's per-token log-probs under the row's processed
distribution (after temperature / top-p, as Hugging Face's scores; a temperature-0 row
reports 0 for its token and -9999 for the rest), one entry per token that `usage` counts (a
special token such as EOS with its own text, which the answer's text leaves out); after a
stop string, `usage.completion_tokens` counts up to and with the token that completed it.
`response_format` json_schema / json_object runs the request on an engine of that schema
(the token automaton masks every step). A client that disconnects has its requests
cancelled (their slots free at the next chunk). Errors: 400 (bad body, malformed JSON too,
an unknown or unsupported field, a chat role other than system / user / assistant /
developer, a prompt + max_tokens over the context: a prompt text longer than the context's
tokens could hold is refused before it is tokenized, jaxgen.serving.prompt_tokens), 401
(api key), 404 (another model's name), 413 (a body over `max_body_bytes`, before it is read
whole), 429 (the queue is full), 503 (shutting down, or an engine failed), 500 (the engine
failed); a stream whose engine fails ends with an error event (`data: {"error": {...}}`)
and `data: [DONE]`. Bodies are parsed and prompts tokenized on worker threads, the
tokenizer without the GIL, so a big request does not hold up the others. `GET /health`:
200 {"status": "ok"}, or 503 {"status": "failed", "error": ...} once an engine failed (it
takes no request again: restart the server).

Example (no request made: the routes of an app over a tiny model):
    >>> from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
    >>> model, params = tiny_llama(vocab_size=TINY_VOCAB)
    >>> app = build_app(model, params, tiny_tokenizer(), model_name="tiny", slots=1,
    ...                 max_len=32)
    >>> sorted(route.path for route in app.routes)
    ['/health', '/v1/chat/completions', '/v1/completions', '/v1/models']
    >>> app.state.pool.close(timeout=60)
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import threading

import anyio
import jax
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jaxgen.api.generate import default_config
from jaxgen.config.fields import check_int
from jaxgen.config.generation import GenerationConfig
from jaxgen.core.context import model_positions
from jaxgen.serving.detokenize import TextAssembler
from jaxgen.serving.engine_pool import EnginePool, PoolBusy
from jaxgen.serving.openai_schema import (
    ApiError,
    envelope,
    floor_logprob,
    new_id,
    now,
    parse_request,
    read_json,
    usage,
)
from jaxgen.serving.prompt_tokens import chars_per_token, encode
from jaxgen.serving.request_body import DEFAULT_MAX_BODY_BYTES, read_body
from jaxgen.serving.requests import EngineClosed, EngineError, QueueFull

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_length": "length"}
DEFAULT_MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs
_LOG = logging.getLogger(__name__)


def server_config(model, tokenizer, max_top_logprobs: int) -> GenerationConfig:
    """The engines' config: sampling with OpenAI's neutral defaults, the model's EOS (else the
    tokenizer's), `max_top_logprobs` alternatives recorded per token."""
    base = default_config(model, None)
    eos = base.eos_token_id
    if eos is None or (isinstance(eos, (tuple, list)) and not eos):
        eos = tokenizer.eos_token_id
    return GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=16, eos_token_id=eos, pad_token_id=base.pad_token_id,
                            top_logprobs=max_top_logprobs)


class _Server:
    """The app's state: the engines, the tokenizer, the limits."""

    def __init__(self, pool: EnginePool, tokenizer, model_name: str, api_key, max_len: int,
                 max_top_logprobs: int, max_body_bytes: int):
        self.pool, self.tokenizer, self.model_name = pool, tokenizer, model_name
        self.api_key, self.max_top_logprobs = api_key, max_top_logprobs
        self.max_body_bytes = max_body_bytes
        positions = model_positions(pool.model)
        self.context = max_len if positions is None else min(max_len, positions)
        self.chars_per_token = chars_per_token(tokenizer)  # None: prompts are only counted
        self.closing = False
        eos = pool.cfg.eos_token_id
        self.special = set(tokenizer.all_special_ids) | set(
            [eos] if isinstance(eos, int) else eos or ())  # ids that are no text

    # ----------------------------------------------------------------- checks
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer "
                                "<key>` with the server's --api-key", code="invalid_api_key")

    def check_open(self) -> None:
        failure = self.pool.failure
        if failure is not None:
            raise ApiError(503, f"the engine failed ({failure!r}): this server takes no new "
                                f"requests; restart it", code="engine_failed")
        if self.closing or self.pool.closed:
            raise ApiError(503, "the server is shutting down: it takes no new requests",
                           code="shutting_down")

    def parse(self, kind: str, raw: bytes):
        """The checked request of a body (on a worker thread: a big body parses there)."""
        return parse_request(kind, read_json(raw), self.max_top_logprobs)

    def check_chars(self, parsed, text: str) -> None:
        """400 context_length_exceeded, before tokenizing, for a prompt text longer than the
        tokens left for it could hold (jaxgen.serving.prompt_tokens)."""
        if self.chars_per_token is None:
            return
        wanted = parsed.max_tokens if parsed.max_tokens is not None else 1
        room = max(self.context - wanted, 0)
        if len(text) > room * self.chars_per_token:
            where = "messages" if parsed.kind == "chat" else "prompt"
            raise ApiError(400, f"This model's maximum context length is {self.context} tokens. "
                                f"However, the {where} has {len(text)} characters, more than "
                                f"the {room} tokens left beside {wanted} in the completion can "
                                f"hold (at most {self.chars_per_token} characters a token). "
                                f"Please reduce the length of the {where} or the completion.",
                           param=where, code="context_length_exceeded")

    def prompt_ids(self, parsed, prompt) -> list:
        if parsed.kind == "chat":
            try:
                text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                          tokenize=False)
            except ValueError as error:
                raise ApiError(400, f"`messages`: the chat template failed: {error}",
                               param="messages", code="invalid_value") from None
            self.check_chars(parsed, text)
            return encode(self.tokenizer, text, add_special_tokens=False)
        if isinstance(prompt, str):
            self.check_chars(parsed, prompt)
            ids = encode(self.tokenizer, prompt)
            if not ids:
                raise ApiError(400, "`prompt`: encodes to no tokens", param="prompt",
                               code="invalid_value")
            return ids
        vocab = self.pool.model.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ApiError(400, f"`prompt`: token ids must be in 0..{vocab - 1}",
                           param="prompt", code="invalid_value")
        return list(prompt)

    def budget(self, parsed, prompt_len: int) -> int:
        room = self.context - prompt_len
        wanted = parsed.max_tokens if parsed.max_tokens is not None else room
        if wanted > room or room < 1:
            where = "messages" if parsed.kind == "chat" else "prompt"
            raise ApiError(400, f"This model's maximum context length is {self.context} tokens. "
                                f"However, you requested {prompt_len + wanted} tokens "
                                f"({prompt_len} in the {where}, {wanted} in the completion). "
                                f"Please reduce the length of the {where} or the completion.",
                           param="max_tokens" if parsed.max_tokens else where,
                           code="context_length_exceeded")
        return wanted

    @staticmethod
    def settings(parsed, choice: int, seed: int) -> dict:
        values = {"key": jax.random.key(seed + choice)}
        if parsed.temperature == 0.0:  # greedy for this row: the argmax only
            values.update(temperature=1.0, top_k=1, top_p=1.0)
        else:
            values.update(temperature=1.0 if parsed.temperature is None else parsed.temperature,
                          top_k=0, top_p=1.0 if parsed.top_p is None else parsed.top_p)
        return values

    def submit_all(self, parsed) -> list:
        """[(prompt ids, handle)] per choice (prompt-major); on a refusal the ones already
        submitted are cancelled."""
        seed = parsed.seed if parsed.seed is not None else secrets.randbits(31)
        seed %= 2**31  # jax.random.key's range, whatever the request sent
        handles = []
        try:
            for prompt in parsed.prompts:
                ids = self.prompt_ids(parsed, prompt)
                budget = self.budget(parsed, len(ids))
                for choice in range(parsed.n):
                    settings = self.settings(parsed, len(handles), seed)
                    try:
                        handle = self.pool.submit(parsed.schema, ids, max_new_tokens=budget,
                                                  **settings)
                    except (QueueFull, PoolBusy) as error:
                        raise ApiError(429, str(error), code="queue_full") from None
                    except EngineClosed as error:
                        self.check_open()  # the engine failed: say so
                        raise ApiError(503, str(error), code="shutting_down") from None
                    except ValueError as error:
                        param = "response_format" if "json_schema" in str(error) else None
                        raise ApiError(400, str(error), param=param,
                                       code="invalid_value") from None
                    handles.append((ids, handle))
        except BaseException:
            for _, handle in handles:
                handle.cancel()
            raise
        return handles

    # ----------------------------------------------------------------- one choice
    def logprob_entry(self, parsed, handle, i: int, token: int, offset: int):
        """Token i's log-prob entry: every counted token has one (a special token with its
        own text, such as "</s>", though the answer's text leaves it out)."""
        if not parsed.logprobs or i >= len(handle.token_logprobs):
            return None
        text = self.tokenizer.decode([token])
        value = floor_logprob(handle.token_logprobs[i])
        tops = handle.top_logprobs[i][:parsed.top_logprobs] if handle.top_logprobs else []
        tops = [(self.tokenizer.decode([t]), floor_logprob(v)) for t, v in tops]
        if parsed.kind == "chat":
            return {"token": text, "logprob": value, "bytes": list(text.encode()),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                     for t, v in tops]}
        return {"token": text, "logprob": value, "top": dict(tops), "offset": offset}

    async def run_choice(self, parsed, handle, index: int, emit):
        """Streams one choice: emit(index, text, logprob entries, finish_reason or None); the
        tokens of its answer: up to and with the one that completed a stop string."""
        text = TextAssembler(self.tokenizer, parsed.stop)
        count = 0
        async for token in _tokens(handle):
            entry = self.logprob_entry(parsed, handle, count, token, len(text.text))
            count += 1
            piece = "" if token in self.special else text.add(token)  # EOS: no text
            if piece or entry:
                await emit(index, piece, [entry] if entry else [], None)
            if text.stopped:
                handle.cancel()
                break
        completion = await anyio.to_thread.run_sync(handle.result)
        if text.stopped:
            reason = "stop"
        elif completion.status == "finished":
            reason = FINISH_REASONS.get(completion.stop_reason, "stop")
        else:
            reason = "abort"  # the server closed it (shutdown)
        await emit(index, text.finish(), [], reason)
        return count


async def _tokens(handle):
    """The handle's new ids as an async iterator (a thread reads its blocking stream)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def pump():
        try:
            for token in handle.tokens():
                loop.call_soon_threadsafe(queue.put_nowait, token)
            loop.call_soon_threadsafe(queue.put_nowait, None)
        except RuntimeError:  # the event loop closed (shutdown): nobody listens
            handle.cancel()

    threading.Thread(target=pump, name="jaxgen-http-tokens", daemon=True).start()
    while (token := await queue.get()) is not None:
        yield token


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _choice_object(parsed, index: int, text: str, entries: list, reason, chunk: bool):
    if parsed.kind == "chat":
        logprobs = {"content": entries} if parsed.logprobs else None
        if chunk:
            delta = {} if reason is not None and not text else {"content": text}
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": reason}
    logprobs = None
    if parsed.logprobs:
        logprobs = {"tokens": [e["token"] for e in entries],
                    "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": [e["top"] for e in entries],
                    "text_offset": [e["offset"] for e in entries]}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)


async def _complete(server: _Server, parsed, handles, request: Request) -> JSONResponse:
    """The whole answer as one object; a client that leaves cancels its requests."""
    texts = [[] for _ in handles]
    entries = [[] for _ in handles]
    reasons = [None] * len(handles)

    async def emit(index, piece, new_entries, reason):
        texts[index].append(piece)
        entries[index].extend(new_entries)
        reasons[index] = reason or reasons[index]

    runs = asyncio.gather(*(server.run_choice(parsed, handle, i, emit)
                            for i, (_, handle) in enumerate(handles)))
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        await asyncio.wait([runs, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not runs.done():  # the client left
            for _, handle in handles:
                handle.cancel()
            runs.cancel()
            return JSONResponse({}, status_code=499)
        counts = runs.result()
    except EngineError as error:
        raise ApiError(500, f"the engine failed: {error}", code="engine_error") from None
    finally:
        watcher.cancel()
    choices = [_choice_object(parsed, i, "".join(texts[i]), entries[i], reasons[i], False)
               for i in range(len(handles))]
    prompt_tokens = sum(len(handles[i][0]) for i in range(0, len(handles), parsed.n))
    return JSONResponse(envelope(parsed.kind, new_id(parsed.kind), server.model_name, now(),
                                 choices, usage=usage(prompt_tokens, sum(counts))))


def _stream(server: _Server, parsed, handles) -> StreamingResponse:
    """Server-sent events: one chunk per piece of text, [DONE] at the end. A client that
    leaves cancels the stream (Starlette), and with it the requests."""
    request_id, created = new_id(parsed.kind), now()
    queue: asyncio.Queue = asyncio.Queue()

    def event(choices, usage_value=None) -> str:
        body = envelope(parsed.kind, request_id, server.model_name, created, choices,
                        chunk=True, usage=usage_value)
        return f"data: {json.dumps(body)}\n\n"

    async def emit(index, piece, entries, reason):
        await queue.put((index, piece, entries, reason))

    async def run(index: int, handle):
        """One choice; a failure is queued as the stream's error (it never waits forever)."""
        try:
            return await server.run_choice(parsed, handle, index, emit)
        except EngineError as error:
            await queue.put(ApiError(500, f"the engine failed: {error}", code="engine_error"))
        except Exception as error:  # a bug: the client learns it, the log keeps it
            _LOG.exception("choice %d of a streamed request failed", index)
            await queue.put(ApiError(500, f"the server failed: {error!r}",
                                     code="server_error"))
        return 0

    async def events():
        tasks = [asyncio.ensure_future(run(i, handle)) for i, (_, handle) in enumerate(handles)]
        try:
            if parsed.kind == "chat":
                yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for i in range(len(handles))])
            ended = 0
            while ended < len(handles):
                item = await queue.get()
                if isinstance(item, ApiError):  # OpenAI's error event, then the end
                    yield f"data: {json.dumps(item.body())}\n\n"
                    break
                index, piece, entries, reason = item
                ended += reason is not None
                yield event([_choice_object(parsed, index, piece, entries, reason, True)])
            else:
                counts = [task.result() for task in tasks]
                if parsed.include_usage:
                    prompt_tokens = sum(len(handles[i][0])
                                        for i in range(0, len(handles), parsed.n))
                    yield event([], usage(prompt_tokens, sum(counts)))
            yield "data: [DONE]\n\n"
        finally:  # finished, failed or the client left: free every slot
            for _, handle in handles:
                handle.cancel()
            for task in tasks:
                task.cancel()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _endpoint(kind: str):
    async def endpoint(request: Request):
        server: _Server = request.app.state.server
        try:
            server.authorize(request)
            server.check_open()
            raw = await read_body(request, server.max_body_bytes)
            parsed = await anyio.to_thread.run_sync(server.parse, kind, raw)
            if parsed.model not in (None, server.model_name):
                raise ApiError(404, f"The model `{parsed.model}` does not exist: this server "
                                    f"serves `{server.model_name}`", param="model",
                               code="model_not_found")
            handles = await anyio.to_thread.run_sync(server.submit_all, parsed)
            if parsed.stream:
                return _stream(server, parsed, handles)
            return await _complete(server, parsed, handles, request)
        except ApiError as error:
            return _error_response(error)

    return endpoint


async def _models(request: Request):
    server: _Server = request.app.state.server
    try:
        server.authorize(request)
    except ApiError as error:
        return _error_response(error)
    return JSONResponse({"object": "list", "data": [
        {"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxgen"}]})


async def _health(request: Request):
    """200 while the server takes requests; 503 once an engine failed (it never will again:
    a supervisor should restart the server)."""
    server: _Server = request.app.state.server
    failure = server.pool.failure
    if failure is not None:
        return JSONResponse({"status": "failed", "error": f"the engine failed: {failure!r}"},
                            status_code=503)
    return JSONResponse({"status": "closing" if server.closing else "ok"})


def build_app(model, params, tokenizer, *, model_name: str, api_key: str | None = None,
              slots: int = 8, max_len: int = 2048, chunk_size: int = 8,
              max_waiting: int = 256, constrained_engines: int = 2,
              constrained_slots: int | None = None,
              max_top_logprobs: int = DEFAULT_MAX_TOP_LOGPROBS, layout: str = "auto",
              shutdown_timeout: float = 30.0, warm_up_lengths=(),
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The ASGI app. Its engines start now (app.state.pool); the lifespan's shutdown stops
    admitting (503) and closes them, cancelling what still runs (shutdown_timeout: seconds
    to wait for their threads). warm_up_lengths: prompt lengths whose programs compile
    before the server takes requests. max_body_bytes: a larger request body gets 413."""
    if tokenizer is None:
        raise ValueError("the server needs the model's tokenizer (text in, text out)")
    check_int("max_body_bytes", max_body_bytes, low=1)
    cfg = server_config(model, tokenizer, max_top_logprobs)
    pool = EnginePool(model, params, tokenizer, cfg, slots=slots, max_len=max_len,
                      chunk_size=chunk_size, max_waiting=max_waiting, layout=layout,
                      constrained_engines=constrained_engines,
                      constrained_slots=constrained_slots)
    server = _Server(pool, tokenizer, model_name, api_key, max_len, max_top_logprobs,
                     max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warm_up_lengths:
            await anyio.to_thread.run_sync(pool.main.warm_up, tuple(warm_up_lengths))
        try:
            yield
        finally:
            server.closing = True
            await anyio.to_thread.run_sync(
                lambda: pool.close(cancel=True, timeout=shutdown_timeout))

    app = Starlette(routes=[
        Route("/v1/chat/completions", _endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", _endpoint("completion"), methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.server, app.state.pool = server, pool
    return app


__all__ = ["build_app", "server_config"]
