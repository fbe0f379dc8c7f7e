"""A request's host side: its settings, its handle (stream, result, cancel) and its end.

`RequestHandle` is what `Engine.submit` returns: iterate it for the new token ids as the
engine produces them (between chunks), `result(timeout)` waits for the `Completion`,
`cancel()` asks the engine to free the request's slot at the next chunk boundary.

Statuses (`Completion.status`):

    finished    the request ended by itself (EOS, its budget, the buffer): `stop_reason`
    cancelled   `cancel()`: the tokens produced so far are kept
    closed      the engine was closed with cancel=True before the request ended
    failed      the engine's thread raised: `result()` raises EngineError from it

Example:
    >>> handle = RequestHandle(0, [1, 2])
    >>> handle._push([7, 8]); handle._finish("finished", "eos")
    >>> list(handle), handle.result(timeout=1).new_ids
    ([7, 8], [7, 8])
"""
from __future__ import annotations

import dataclasses
import queue
import threading

STATUSES = ("finished", "cancelled", "closed", "failed")
_END = object()


class QueueFull(RuntimeError):
    """The engine's waiting queue holds `max_waiting` requests: submit later."""


class EngineClosed(RuntimeError):
    """The engine was closed: it takes no new requests."""


class EngineError(RuntimeError):
    """The engine's thread raised while the request was waiting or running."""


@dataclasses.dataclass(frozen=True)
class Completion:
    """A request's end: the prompt and new ids, how it ended."""

    prompt_ids: list
    new_ids: list
    status: str  # one of STATUSES
    stop_reason: str | None  # jaxgen.stopping.STOP_REASONS' name (status "finished"), else None

    @property
    def ids(self) -> list:
        """Prompt + new ids (a row of jaxgen.generate_ids' output)."""
        return self.prompt_ids + self.new_ids


class RequestHandle:
    """One submitted request: stream its new ids, wait for its result, cancel it."""

    def __init__(self, request_id: int, prompt_ids: list):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self._new: list = []
        self.token_logprobs: list = []  # float per new token (filled before it streams)
        self.top_logprobs: list = []  # per new token: [(id, log-prob), ...] (engine's top k)
        self._stream: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._completion: Completion | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------- the caller's side
    def cancel(self) -> None:
        """Asks the engine to end this request at the next chunk boundary (its slot is freed
        then; a waiting request is dropped from the queue)."""
        self._cancel.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        """The Completion, once the request ended (TimeoutError after `timeout` seconds;
        EngineError when the engine failed)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not end within {timeout} s")
        if self._error is not None:
            raise EngineError(f"the engine failed while running request {self.request_id}: "
                              f"{self._error!r}") from self._error
        return self._completion

    def tokens(self, timeout: float | None = None):
        """The new token ids, one at a time, as the engine produces them (TimeoutError when
        none comes within `timeout` seconds)."""
        while True:
            try:
                item = self._stream.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id}: no token within {timeout} s") \
                    from None
            if item is _END:
                self._stream.put(_END)  # a second iteration ends at once too
                return
            yield item

    def __iter__(self):
        return self.tokens()

    # ------------------------------------------------------------- the engine's side
    def _push(self, ids, logprobs=None, top=None) -> None:
        """New ids [n]; their log-probs [n]; top: (ids [n, k], log-probs [n, k]) or None."""
        for i, token in enumerate(ids):
            if logprobs is not None:
                self.token_logprobs.append(float(logprobs[i]))
            if top is not None:
                self.top_logprobs.append([(int(t), float(v)) for t, v in zip(top[0][i],
                                                                           top[1][i])])
            self._new.append(int(token))
            self._stream.put(int(token))

    def _finish(self, status: str, stop_reason: str | None = None,
                error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self._completion = Completion(self.prompt_ids, list(self._new), status, stop_reason)
        self._error = error
        self._stream.put(_END)
        self._done.set()


__all__ = ["Completion", "EngineClosed", "EngineError", "QueueFull", "RequestHandle",
           "STATUSES"]
