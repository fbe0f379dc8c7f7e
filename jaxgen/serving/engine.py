"""`Engine`: continuous batching over a fixed number of slots, on a background thread.

One fixed-shape state holds `slots` rows of `max_len` tokens (jaxgen.serving.admission). The
thread repeats a host step and a chunk:

  * host step: read the rows, hand every running request its new tokens, retire the rows
    that are done (their slot is free), end the rows whose request was cancelled, then admit
    waiting requests into the free slots (their prompts prefilled straight into their slots
    together, `prefill_width` positions of each a call, a prompt's last chunk choosing its
    first token: jaxgen.serving.admission.PrefillChunkLoop);
  * chunk: `chunk_size` steps of the plain decode loop over every slot, on the cache cropped
    to the positions the live rows reach (jaxgen.runtime.compiled.advance with
    jaxgen.serving.visible_loop.VisibleDecodeLoop, the chunked driver's entry), fewer once
    every slot is done.

Budgets, keys, per-row sampling values and the slots' contents are dynamic, so requests
coming and going compile nothing new: a chunk program per rung of cropped lengths and an
admission program per power-of-two count of newcomers, whatever the prompts' lengths
(`warm_up` compiles them all ahead; a speculative engine runs its rounds on the whole cache
and admits through one program per power-of-two newcomers and prompt bucket instead). A
greedy request's tokens equal a solo `jaxgen.generate_ids` call's; a sampled one's too,
with the same key.

Example:
    >>> import jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    >>> with Engine(model, params, cfg, slots=2, max_len=32, chunk_size=2) as engine:
    ...     handles = [engine.submit([1, 2, 3]), engine.submit([4, 5], max_new_tokens=2)]
    ...     done = [h.result(timeout=120) for h in handles]
    >>> [(len(c.new_ids), c.status) for c in done]
    [(4, 'finished'), (2, 'finished')]
"""
from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen import stopping
from jaxgen.api.generate import default_config
from jaxgen.api.plan import canonical_config, choose_drafter
from jaxgen.config.fields import check_int
from jaxgen.config.generation import GenerationConfig
from jaxgen.config.program import program_config
from jaxgen.core.context import check_context, model_positions
from jaxgen.core.output import StepRecord
from jaxgen.cache.layer_forms import to_layer_tuples
from jaxgen.cache.time_prefix import crops_time
from jaxgen.core.state import prompt_bucket, resolve_pad_id, row_keys, typed_keys
from jaxgen.runtime import compiled
from jaxgen.serving.admission import (
    DEFAULT_PREFILL_WIDTH,
    PrefillChunkLoop,
    admission_rows,
    check_slots_fit,
    empty_slots,
    host_admission,
    host_chunks,
    next_chunk,
    prefill_widths,
    slot_cache_axes,
)
from jaxgen.serving.requests import EngineClosed, QueueFull, RequestHandle
from jaxgen.serving.spec_slots import SpeculativeSlots, check_speculative, since_sent
from jaxgen.serving.visible_loop import VisibleDecodeLoop, pick_visible, visible_lengths
from jaxgen.serving.settings import (
    SAMPLING_FIELDS,
    check_engine_config,
    request_values,
)

DEFAULT_MAX_WAITING = 1024


class _Request:
    """A submitted request as the engine holds it (host values)."""

    def __init__(self, handle, budget, key, values):
        self.handle, self.budget, self.key, self.values = handle, budget, key, values


def _logprob_parts(record: StepRecord) -> tuple:
    """(token_logprobs [R, N], top_ids [R, N, k] | None, top_logprobs [R, N, k] | None)."""
    return record.token_logprobs, record.top_ids, record.top_logprobs


def _row_logprobs(chunk: tuple, slot: int, count: int, first: tuple | None) -> tuple:
    """(log-probs [count], (top ids, top log-probs) [count, k] or None) of a slot's `count`
    new tokens: the admission's first token (first: (its parts, its row)), then the chunk's
    steps."""
    parts = [None if part is None else part[slot] for part in chunk]  # [N(, k)] each
    if first is not None:
        head, row = first
        parts = [None if part is None else np.concatenate([first_part[row, :1], part])
                 for part, first_part in zip(parts, head)]
    logprobs, top_ids, top_logprobs = (None if p is None else np.asarray(p)[:count]
                                       for p in parts)
    return logprobs, None if top_ids is None else (top_ids, top_logprobs)


class Engine:
    """Continuous batching: `submit` prompts, each decoded in a slot as one frees up.

    model, params: a jaxgen model and its weights; cfg: the program-wide GenerationConfig
    (with `overrides`, resolved as jaxgen.generate_ids does; see jaxgen.serving.settings for
    what a request may set itself). slots: rows decoded together. max_len: each slot's
    buffer (prompt + new tokens): 2 .. the model's max_position_embeddings, and slots x
    max_len must fit the device's memory (ValueError before allocating otherwise).
    chunk_size: decode steps between host steps.
    prefill_width: the most prompt positions one admission chunk prefills. max_waiting:
    the waiting queue's bound (`submit` raises QueueFull past it). layout: the programs'
    layout (jaxgen.runtime.backend.LAYOUTS). constraint: a TokenAutomaton every request
    follows (jaxgen.constraints.compile), or None. Each handle also gets its tokens'
    log-probs (and, with cfg.top_logprobs = k, the k most likely alternatives).
    Speculative decoding: prompt_lookup_num_tokens=K, use_mtp=True or assistant_model=
    (draft, draft_params) make each chunk `chunk_size` assisted rounds, every row accepting
    its own drafts (jaxgen.serving.spec_slots; greedy tokens equal a solo generate call).
    `failure`: the exception that ended the engine's thread (None while it runs or after a
    clean close); every request then ended "failed" and submit raises EngineClosed.
    """

    def __init__(self, model, params, cfg: GenerationConfig | None = None, *, slots: int = 8,
                 max_len: int = 512, chunk_size: int = 8,
                 max_waiting: int = DEFAULT_MAX_WAITING, layout: str = "auto",
                 cache_dtype=jnp.float32, constraint=None, assistant_model=None,
                 prefill_width: int = DEFAULT_PREFILL_WIDTH, **overrides):
        check_int("slots", slots, low=1)
        check_int("max_len", max_len, low=2)
        check_int("chunk_size", chunk_size, low=1)
        check_int("prefill_width", prefill_width, low=1)
        check_int("max_waiting", max_waiting, low=1)
        cfg = default_config(model, cfg, **overrides)
        check_engine_config(cfg)
        cfg.validate_for_model(model.vocab_size)
        self.model, self.params, self.cfg = model, params, cfg
        self.slots, self.max_len, self.chunk_size = slots, max_len, chunk_size
        self.max_waiting, self.layout = max_waiting, layout
        self._pad = resolve_pad_id(cfg, model)
        check_slots_fit(model, cfg, slots, max_len, cache_dtype)
        self._state = empty_slots(model, cfg, slots, max_len, cache_dtype, constraint)
        self._first: dict = {}  # slot -> (first-token StepRecord [N, 1], its row): admitted
        self._axes = slot_cache_axes(model, cfg, max_len)  # the cache leaves' batch axes
        self.prefill_width = min(prefill_width, max_len)
        self._widths = prefill_widths(self.prefill_width)  # an admission call's widths
        self._chunk_loop = PrefillChunkLoop(axes=self._axes)
        # the padded newcomer counts an admission program is compiled for
        self._admission_counts = sorted({admission_rows(n, slots) for n in range(1, slots + 1)})
        self._record = StepRecord.empty(slots, chunk_size, model.vocab_size, cfg)
        self._values = {name: np.full((slots,), getattr(cfg, name)) for name in SAMPLING_FIELDS}
        self._chunk_cfg = self._program_cfg(self._values)
        self._spec = self._speculative(assistant_model, constraint)
        if self._spec is None and compiled.runs_layers_apart(
                params, self._state, self._chunk_loop, self._chunk_cfg, layout):
            # the forward runs layer by layer: the slots' cache is kept as one buffer per
            # layer, so no call splits it and stacks it back (a copy of all of it)
            self._state = self._state.replace(cache=to_layer_tuples(self._state.cache))
            self._axes = slot_cache_axes(model, cfg, max_len, layer_tuples=True)
            self._chunk_loop = PrefillChunkLoop(axes=self._axes)
        # the decode chunk's cropped cache lengths (a speculative engine's rounds run whole)
        self._ladder = (visible_lengths(max_len) if self._spec is None
                        and crops_time(self._state.cache) else (max_len,))
        # its chunk programs and admission programs stay alive beside everyone else's
        self._reserved = len(self._ladder) + len(self._admission_counts) * len(self._widths)
        compiled.reserve_programs(self._reserved)
        self._running: list = [None] * slots  # the _Request in each slot
        self._sent = np.zeros((slots,), np.int64)  # tokens of each slot handed out
        self._waiting: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._device = threading.Lock()  # the thread's step and warm_up take turns
        self._closing = False
        self._cancel_all = False
        self.failure: BaseException | None = None  # what ended the thread, when it failed
        self._next_id = 0
        self._thread = threading.Thread(target=self._run, name="jaxgen-serving", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- the caller's side
    def submit(self, prompt_ids, **settings) -> RequestHandle:
        """Queues a prompt (a list of token ids); returns its RequestHandle. settings:
        max_new_tokens, key (jax.random.key(seed)), and with a sampling engine temperature,
        top_k, top_p. Raises QueueFull when `max_waiting` requests wait, EngineClosed after
        close(), ValueError for a bad prompt or setting."""
        prompt = self._check_prompt(prompt_ids)
        values = request_values(self.cfg, settings)
        budget = self._budget(len(prompt), settings.get("max_new_tokens"))
        key = typed_keys(settings.get("key"))
        if key.shape not in ((), (1,)):
            raise ValueError(f"submit: `key` must be one PRNG key (jax.random.key(seed)), or "
                             f"a [1] array holding the row's own key, got shape {key.shape}")
        # the solo call's row key: fold_in(key, 0) for one key, a [1] row key as it is
        row_key = row_keys(key, 1)[0]
        with self._cond:
            if self._closing:
                raise EngineClosed("the engine is closed: it takes no new requests")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"the engine's waiting queue is full ({self.max_waiting} "
                                f"requests, max_waiting); submit again once requests finish")
            handle = RequestHandle(self._next_id, prompt)
            self._next_id += 1
            self._waiting.append(_Request(handle, budget, row_key, values))
            self._cond.notify_all()
        return handle

    def warm_up(self, prompt_lengths=(1,)) -> None:
        """Compiles the chunk program and the admission programs ahead of the requests
        (admitting nobody); a speculative engine's, for prompts of these lengths' buckets."""
        key = row_keys(jax.random.key(0), 1)[0]
        with self._device:
            if self._spec is None:  # prompts into no slot: each newcomer count and width
                piece = ([self._pad], 0, 1, key, self.slots, True, self._neutral())
                for count in self._admission_counts:
                    for width in self._widths:
                        self._prefill_chunk([piece] * count, width)
            else:
                self._warm_speculative(prompt_lengths, key)
            if all(r is None for r in self._running):  # every slot done: steps nothing
                for visible in self._ladder:
                    self._advance(visible)
        jax.block_until_ready(self._state.length)

    def _warm_speculative(self, prompt_lengths, key) -> None:
        buckets = sorted({min(prompt_bucket(int(n)), self.max_len) for n in prompt_lengths})
        for bucket in buckets:
            for count in self._admission_counts:
                self._state = self._admit([[self._pad]] * count, [1] * count, [key] * count,
                                          [self.slots] * count, [self._neutral()] * count,
                                          bucket)

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Takes no new requests; ends the thread once every request ended (cancel=False),
        or ends every waiting and running request now with status "closed" (cancel=True,
        at the next chunk boundary). TimeoutError when the thread is still busy after
        `timeout` seconds."""
        with self._cond:
            self._closing = True
            self._cancel_all = self._cancel_all or cancel
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine's thread did not end within {timeout} s")

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.close(cancel=error is not None)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests in a slot."""
        return sum(r is not None for r in self._running)

    def speculative_counts(self) -> dict:
        """A speculative engine's drafts proposed ("drafted"), accepted ("accepted") and
        verify rounds ("rounds"), summed over every request so far."""
        if self._spec is None:
            raise ValueError("speculative_counts: this engine does not draft (build it with "
                             "prompt_lookup_num_tokens= or assistant_model=)")
        with self._device:
            return self._spec.counts()

    # ----------------------------------------------------------------- checks
    def _check_prompt(self, prompt_ids) -> list:
        if isinstance(prompt_ids, (np.ndarray, jax.Array)):
            prompt_ids = np.asarray(prompt_ids).reshape(-1).tolist()
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError(f"submit: `prompt_ids` must be a non-empty list of token ids, got "
                             f"{prompt_ids!r}")
        vocab = self.model.vocab_size
        for token in prompt_ids:
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) \
                    or not 0 <= token < vocab:
                raise ValueError(f"submit: `prompt_ids` holds {token!r}; token ids are ints in "
                                 f"0..{vocab - 1}")
        return [int(t) for t in prompt_ids]

    def _budget(self, prompt_len: int, max_new) -> int:
        if max_new is None:
            max_new = self.cfg.max_new_tokens
        if max_new is None:
            max_new = int(self.cfg.max_length) - prompt_len
            if max_new < 1:
                raise ValueError(f"submit: the prompt has {prompt_len} tokens but max_length is "
                                 f"{self.cfg.max_length}; set max_new_tokens")
        check_int("max_new_tokens", max_new, low=1)
        if prompt_len + max_new > self.max_len:
            raise ValueError(f"submit: prompt ({prompt_len}) + max_new_tokens ({max_new}) does "
                             f"not fit a slot (max_len={self.max_len}); shorten them or build "
                             f"the Engine with a larger max_len")
        check_context(model_positions(self.model), [prompt_len], int(max_new),
                      where=lambda _: "submit: the prompt")
        return int(max_new)

    # ----------------------------------------------------------------- programs
    def _neutral(self) -> dict:
        return {name: getattr(self.cfg, name) for name in SAMPLING_FIELDS}

    def _program_cfg(self, values: dict) -> GenerationConfig:
        """The program config with per-row sampling values (sampling engines)."""
        cfg = self.cfg
        if cfg.do_sample:
            cfg = cfg.replace(**{name: np.asarray(values[name]) for name in SAMPLING_FIELDS})
        return program_config(canonical_config(cfg))

    def _speculative(self, assistant_model, constraint) -> SpeculativeSlots | None:
        """The assisted loop's slots for a config that drafts (prompt lookup) or an
        assistant_model=(model, params); None for the plain engine."""
        drafter, inputs = choose_drafter(self.cfg, self.model, assistant_model, None)
        if drafter is None:
            return None
        check_speculative(self.cfg, drafter, constraint)
        values = lambda rows: {name: np.full((rows,), getattr(self.cfg, name))  # noqa: E731
                               for name in SAMPLING_FIELDS}
        spec = SpeculativeSlots(self.model, self.params, self.cfg, self._state, drafter,
                                inputs, lambda rows: self._program_cfg(values(rows)),
                                self._axes, self.max_len)
        self._record = spec.record
        return spec

    def _prefill(self, newcomers: list) -> dict:
        """Prefills the newcomers' prompts into their slots together, chunk after chunk
        (newcomers: (prompt, budget, key, values, slot)), each call as wide as the longest
        rest of a prompt needs (one of `prefill_widths`); {slot: (its first token's
        StepRecord [N, 1], its row)}."""
        done = [0] * len(newcomers)  # positions of each prompt in its slot's cache
        firsts = {}
        while live := [i for i, n in enumerate(newcomers) if done[i] < len(n[0])]:
            rest = min(max(len(newcomers[i][0]) - done[i] for i in live), self.prefill_width)
            width = next(w for w in self._widths if w >= rest)
            pieces = []
            for i in live:
                prompt, budget, key, values, slot = newcomers[i]
                start, last = next_chunk(done[i], len(prompt), width, self.max_len)
                pieces.append((prompt, start, budget, key, slot, last, values))
                done[i] = len(prompt) if last else start + width
            record = self._prefill_chunk(pieces, width)
            firsts.update({piece[4]: (record, row) for row, piece in enumerate(pieces)
                           if piece[5]})
        return firsts

    def _prefill_chunk(self, pieces: list, width: int) -> StepRecord:
        """One admission call: a `width`-position chunk of each newcomer's prompt (pieces:
        (prompt, start, budget, key, slot, last, values); slot `slots`: into no slot, which
        compiles only); the first tokens' StepRecord [N, 1]."""
        rows = admission_rows(len(pieces), self.slots)
        values = [piece[6] for piece in pieces] + [self._neutral()] * (rows - len(pieces))
        cfg = self._program_cfg({name: np.asarray([v[name] for v in values])
                                 for name in SAMPLING_FIELDS})
        chunk = host_chunks([piece[:6] for piece in pieces], rows, width, self.max_len,
                            self._pad, no_slot=self.slots)
        self._state, record = compiled.start(self.params, self._state, cfg, chunk,
                                             loop=self._chunk_loop, layout=self.layout)
        return record

    def _admit(self, prompts, budgets, keys, slots, values, bucket):
        """A speculative engine's admission: the newcomers prefilled apart, then scattered
        in with their carry rows (jaxgen.serving.spec_slots)."""
        rows = admission_rows(len(prompts), self.slots)
        padded = values + [self._neutral()] * (rows - len(values))
        admission = host_admission(prompts, budgets, keys, slots, rows, bucket, self._pad,
                                   no_slot=self.slots)
        cfg = self._program_cfg({name: np.asarray([v[name] for v in padded])
                                 for name in SAMPLING_FIELDS})
        state = self._spec.admit(self.params, self._state, cfg, admission, slots, self.layout)
        self._record = self._spec.record
        return state

    def _visible(self) -> int:
        """The chunk's cropped cache length: every running row's length after the chunk."""
        reach = max((int(self._sent[slot]) + 1 for slot, r in enumerate(self._running)
                     if r is not None), default=1)  # a newcomer's first token is not sent yet
        return pick_visible(self._ladder, reach + self.chunk_size)

    def _advance(self, visible: int | None = None) -> None:
        if self._spec is not None:  # chunk_size assisted rounds
            self._state = self._spec.advance(self.params, self._state, self._chunk_cfg,
                                             self.chunk_size, self.layout)
            self._record = self._spec.record
            return
        self._state, self._record = compiled.advance(
            self.params, self._state, self._record, jnp.int32(0), jnp.int32(self.chunk_size),
            self._chunk_cfg, None, loop=VisibleDecodeLoop(visible=visible or self._visible()),
            layout=self.layout)

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while True:
                with self._device:
                    self._host_step()
                with self._cond:
                    if self._closing and (self._cancel_all or (
                            not self._waiting and self.running == 0)):
                        break
                    if self.running == 0 and not self._waiting:
                        self._cond.wait()
                        continue
                if self.running == 0:
                    continue
                with self._device:
                    self._advance()
            self._end_all("closed")
        except BaseException as error:  # every request learns it; none hangs
            self.failure = error
            self._end_all("failed", error)
        finally:
            compiled.release_programs(self._reserved)

    def _host_step(self) -> None:
        """Hands out new tokens, retires done / cancelled rows, admits waiting requests."""
        done, length, reason, tokens = (np.asarray(a) for a in jax.device_get((
            self._state.done, self._state.length, self._state.stop_reason,
            self._state.tokens)))
        chunk, firsts = jax.device_get((_logprob_parts(self._record), {
            slot: _logprob_parts(record) for slot, (record, _) in self._first.items()}))
        if self._spec is not None:  # its record is indexed by new-token number
            chunk = since_sent(chunk, [0 if r is None else self._sent[s] - len(
                r.handle.prompt_ids) for s, r in enumerate(self._running)])
        ended = []
        for slot, request in enumerate(self._running):
            if request is None:
                continue
            handle = request.handle
            new = tokens[slot, self._sent[slot]:length[slot]]  # [n]
            first = self._first.pop(slot, None)
            handle._push(new, *_row_logprobs(chunk, slot, len(new), first and (
                firsts[slot], first[1])))
            self._sent[slot] = length[slot]
            if done[slot]:
                handle._finish("finished", stopping.STOP_REASONS[int(reason[slot])])
            elif handle.cancel_requested or self._cancel_all:
                handle._finish("closed" if self._cancel_all else "cancelled")
                ended.append(slot)
            else:
                continue
            self._running[slot] = None
        if ended:  # their rows stop decoding: done from now on
            done = done.copy()
            done[ended] = True
            reason = reason.copy()
            reason[ended] = stopping.CANCELLED
            self._state = self._state.replace(done=jax.device_put(done),
                                              stop_reason=jax.device_put(reason))
        if not self._cancel_all:
            self._admit_waiting()

    def _admit_waiting(self) -> None:
        free = [slot for slot, request in enumerate(self._running) if request is None]
        taken = []
        with self._cond:
            for request in [r for r in self._waiting if r.handle.cancel_requested]:
                self._waiting.remove(request)  # cancelled while waiting: never admitted
                request.handle._finish("cancelled")
            while free and self._waiting:
                request = self._waiting.popleft()
                if request.handle.cancel_requested:
                    request.handle._finish("cancelled")
                    continue
                taken.append((free.pop(0), request))
        if not taken:
            return
        if self._spec is not None:
            requests = [request for _, request in taken]
            prompts = [r.handle.prompt_ids for r in requests]
            bucket = min(prompt_bucket(max(len(p) for p in prompts)), self.max_len)
            self._state = self._admit(prompts, [r.budget for r in requests],
                                      [r.key for r in requests], [slot for slot, _ in taken],
                                      [r.values for r in requests], bucket)
        else:  # the plain engine: every newcomer's prompt in chunks, together
            self._first.update(self._prefill([
                (r.handle.prompt_ids, r.budget, r.key, r.values, slot) for slot, r in taken]))
        for slot, request in taken:
            self._running[slot] = request
            self._sent[slot] = len(request.handle.prompt_ids)
            for name in SAMPLING_FIELDS:
                self._values[name][slot] = request.values[name]
        if self.cfg.do_sample:
            self._chunk_cfg = self._program_cfg(self._values)

    def _end_all(self, status: str, error: BaseException | None = None) -> None:
        with self._cond:
            self._closing = True
            waiting = list(self._waiting)
            self._waiting.clear()
        for request in waiting + [r for r in self._running if r is not None]:
            request.handle._finish(status, error=error)
        self._running = [None] * self.slots


__all__ = ["Engine", "DEFAULT_MAX_WAITING"]
