"""Continuous batching: requests decoded in a fixed number of slots as they come and go.

Modules, lowest first (each imports only modules above it in this list):

    requests    RequestHandle, Completion, QueueFull, EngineClosed, EngineError
    settings    what the engine's config may hold and what a request may set per row
    admission   the slots' state and the admission program (prefill apart, scatter in)
    engine      Engine: the background thread, host steps between decode chunks
    offline     generate_batch: many prompts, one result each, in order
"""
from jaxgen.serving.engine import Engine
from jaxgen.serving.offline import generate_batch
from jaxgen.serving.requests import (
    Completion,
    EngineClosed,
    EngineError,
    QueueFull,
    RequestHandle,
)

__all__ = ["Engine", "generate_batch", "Completion", "EngineClosed", "EngineError",
           "QueueFull", "RequestHandle"]
