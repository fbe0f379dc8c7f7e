"""The server's engines: one for free text, a few for JSON-schema outputs (an LRU).

Every slot of an Engine runs one program, and a constraint's automaton is part of the
slots' state (jaxgen.serving.admission), so requests with different `response_format`
schemas cannot share an engine: each schema gets an engine of its own
(`constrained_slots` slots, the automaton compiled once by jaxgen.constraints.compile),
kept in a least-recently-used table of at most `constrained_engines`. A new schema evicts
the least recently used idle engine; when every one is busy the request is refused with
`PoolBusy` (HTTP 429). Requests are submitted under the pool's lock, so an engine is never
closed between being chosen and taking the request.

Example:
    >>> import jaxgen
    >>> from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
    >>> model, params = tiny_llama(vocab_size=TINY_VOCAB)
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=12, eos_token_id=256)
    >>> pool = EnginePool(model, params, tiny_tokenizer(), cfg, slots=1, max_len=32)
    >>> handle = pool.submit({"enum": ["yes", "no"]}, [104, 105])
    >>> pool.tokenizer.decode(handle.result(timeout=120).new_ids) in ("\\"yes\\"</s>", "\\"no\\"</s>")
    True
    >>> pool.close(cancel=True, timeout=120)
"""
from __future__ import annotations

import collections
import json
import threading

from jaxgen.constraints.compile import compile_constraint
from jaxgen.constraints.index_build import ConstraintBuildBusy
from jaxgen.serving.engine import Engine


class PoolBusy(RuntimeError):
    """Every constrained engine is busy and a new schema needs one."""


class EnginePool:
    """The free-text Engine (`main`) and an LRU of constrained ones. engine_options: the
    Engine's keywords (slots, max_len, chunk_size, max_waiting, layout)."""

    def __init__(self, model, params, tokenizer, cfg, *, constrained_engines: int = 2,
                 constrained_slots: int | None = None, **engine_options):
        if constrained_engines < 0:
            raise ValueError(f"constrained_engines must be >= 0, got {constrained_engines}")
        self.model, self.params, self.tokenizer, self.cfg = model, params, tokenizer, cfg
        self.options = engine_options
        self.main = Engine(model, params, cfg, **engine_options)
        self.limit = constrained_engines
        self.constrained_slots = constrained_slots or max(1, self.main.slots // 4)
        self._engines: collections.OrderedDict = collections.OrderedDict()  # key -> Engine
        self._lock = threading.Lock()
        self.closed = False
        self._failure: BaseException | None = None  # the first engine failure, kept for good

    def _engine(self, schema, built):
        """The engine of `schema` (under the lock): found, or made in an idle one's place."""
        key = json.dumps(schema, sort_keys=True)
        engine = self._engines.get(key)
        if engine is not None:
            self._engines.move_to_end(key)
            return engine
        if len(self._engines) >= self.limit:
            idle = [k for k, e in self._engines.items() if e.running == 0 and e.waiting == 0]
            if not idle:
                raise PoolBusy(f"all {self.limit} constrained engines (one per response "
                               f"schema) are busy; retry later or use a schema already in "
                               f"use")
            evicted = self._engines.pop(idle[0])
            self._failure = self._failure or evicted.failure  # a failure outlives its engine
            evicted.close()
        engine = Engine(self.model, self.params, self.cfg,
                        **{**self.options, "slots": self.constrained_slots},
                        constraint=built.automaton)
        self._engines[key] = engine
        return engine

    def submit(self, schema, prompt_ids, **settings):
        """A RequestHandle from the engine for `schema` (None: free text). ValueError for a
        schema the automaton compiler refuses; PoolBusy; the Engine's own errors."""
        if schema is not None:
            if self.limit == 0:
                raise ValueError("response_format schemas are turned off on this server "
                                 "(constrained_engines=0)")
            try:
                built = compile_constraint(self.tokenizer, self.model.vocab_size,
                                           json_schema=schema)  # cached; outside the lock
            except ConstraintBuildBusy as busy:
                raise PoolBusy(str(busy)) from None
        with self._lock:
            engine = self.main if schema is None else self._engine(schema, built)
            return engine.submit(prompt_ids, **settings)

    @property
    def failure(self) -> BaseException | None:
        """What ended an engine's thread (Engine.failure): the free-text engine's, else the
        first failed constrained engine's; None while every engine runs. Once seen it stays
        (an evicted failed engine does not turn the server healthy again)."""
        with self._lock:
            if self._failure is None:
                engines = [self.main, *self._engines.values()]
                self._failure = next((e.failure for e in engines if e.failure is not None),
                                     None)
            return self._failure

    @property
    def running(self) -> int:
        """Requests in a slot, over every engine."""
        with self._lock:
            return self.main.running + sum(e.running for e in self._engines.values())

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Closes every engine (see Engine.close)."""
        with self._lock:
            self.closed = True
            engines = [self.main, *self._engines.values()]
        for engine in engines:
            engine.close(cancel=cancel, timeout=timeout)


__all__ = ["EnginePool", "PoolBusy"]
