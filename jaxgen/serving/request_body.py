"""A request's body, read up to a byte limit: past it the server answers 413 before parsing.

A declared `Content-Length` past the limit is refused before any of the body is read; a body
sent without one (chunked) is refused as soon as what arrived passes the limit. So one
client cannot make the server hold (or parse) more than `max_bytes` of its body.

Example:
    >>> import asyncio
    >>> class Sent:  # a Starlette request's two parts this module reads
    ...     headers = {"content-length": "11"}
    ...     async def stream(self):
    ...         yield b"hello "; yield b"world"
    >>> asyncio.run(read_body(Sent(), max_bytes=64))
    b'hello world'
    >>> try:
    ...     asyncio.run(read_body(Sent(), max_bytes=8))
    ... except ApiError as error:
    ...     error.status, error.code
    (413, 'request_too_large')
"""
from __future__ import annotations

from jaxgen.serving.openai_schema import ApiError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # 4 MiB: ~1M prompt tokens as text, far past any context


def _too_large(size: int, max_bytes: int, declared: bool) -> ApiError:
    said = "declares" if declared else "sent more than"
    return ApiError(413, f"the request body {said} {size} bytes; this server takes at most "
                         f"{max_bytes} (its --max-body-bytes)", code="request_too_large")


async def read_body(request, max_bytes: int) -> bytes:
    """The body's bytes; ApiError 413 once it is known to pass `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes, declared=True)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes, max_bytes, declared=False)
        chunks.append(chunk)
    return b"".join(chunks)


__all__ = ["DEFAULT_MAX_BODY_BYTES", "read_body"]
