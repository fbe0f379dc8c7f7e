"""A model load, announced: `jaxgen.models.load` calls `announce_model_load(weights,
file_bytes)` before it reads any weight, and every listener hears it while the load runs.
The facade (`import jaxgen`) listens: it starts the CPU backend's kernel builds through
`jaxgen.runtime.backend`, which no module below it may import.

    weights      "float", "int8" or "gguf" (load's `weights=`, checked)
    file_bytes   the size of the files the weights come from (None: not known)

Example:
    >>> heard = []
    >>> stop = listen_to_model_loads(lambda *load: heard.append(load))
    >>> announce_model_load("int8", 1024)
    >>> heard
    [('int8', 1024)]
    >>> stop()
    >>> announce_model_load("float", 1024)
    >>> len(heard)
    1
"""
from __future__ import annotations

import threading
from typing import Callable

Listener = Callable[[str, "int | None"], None]

_LISTENERS: list[Listener] = []
_LOCK = threading.Lock()


def listen_to_model_loads(listener: Listener) -> Callable[[], None]:
    """Calls `listener(weights, file_bytes)` at every announced load from now on (once, however
    often it is added); returns the function that stops it."""
    with _LOCK:
        if listener not in _LISTENERS:
            _LISTENERS.append(listener)

    def stop() -> None:
        with _LOCK:
            if listener in _LISTENERS:
                _LISTENERS.remove(listener)

    return stop


def announce_model_load(weights: str, file_bytes: int | None) -> None:
    """Tells every listener that weights of this kind, from files of this size, are loading."""
    with _LOCK:
        listeners = list(_LISTENERS)
    for listener in listeners:
        listener(weights, file_bytes)


__all__ = ["announce_model_load", "listen_to_model_loads"]
