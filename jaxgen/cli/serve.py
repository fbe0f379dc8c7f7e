"""`jaxgen serve`: an OpenAI-compatible HTTP server (jaxgen.serving.http_app) under uvicorn.

    $ jaxgen serve                                   # the embedded SmolLM2 on 127.0.0.1:8000
    $ jaxgen serve --model ./hf-folder --port 8080 --api-key secret --slots 16

SIGTERM / Ctrl-C: uvicorn stops accepting connections, waits up to --grace seconds for the
requests in flight, then the app's shutdown cancels what still runs and closes the engines;
the process exits 0.

Example:
    >>> args = build_parser().parse_args(["--port", "9000", "--slots", "4"])
    >>> args.host, args.port, args.slots, args.model
    ('127.0.0.1', 9000, 4, None)
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys

from jaxgen.cli.errors import EXIT_MODEL, EXIT_USAGE, CliError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise CliError(f"{message} (see jaxgen serve --help)", EXIT_USAGE)


def _integer(low: int, high: int | None = None):
    """An argparse type: an int in low..high (high None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


_positive = _integer(1)


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") \
            from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxgen serve",
                     description="Serve a model over OpenAI's HTTP API (chat, completions).")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face checkpoint folder, a .gguf file or a known name "
                             "(default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_integer(1, 65535), default=8000,
                        help="the TCP port (1..65535, default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` (default: "
                             "$JAXGEN_API_KEY, else no key)")
    parser.add_argument("--slots", type=_positive, default=8,
                        help="requests decoded together (the engine's rows)")
    parser.add_argument("--max-len", type=_integer(2), default=None,
                        help="tokens per slot, prompt + answer: 2 .. the model's context "
                             "(default: the model's context, at most 2048)")
    parser.add_argument("--chunk-size", type=_positive, default=8,
                        help="decode steps between host steps (streaming granularity)")
    parser.add_argument("--max-waiting", type=_positive, default=256,
                        help="queued requests before the server answers 429")
    parser.add_argument("--grace", type=_seconds, default=10.0,
                        help="seconds in-flight requests get to finish on shutdown (>= 0)")
    parser.add_argument("--max-body-bytes", type=_positive, default=None,
                        help="the largest request body taken; a larger one gets 413 "
                             "(default 4 MiB)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    return parser


def main(argv) -> int:
    """Runs the server until SIGTERM / Ctrl-C; the exit code."""
    try:
        args = build_parser().parse_args(argv)
    except CliError as error:
        print(f"jaxgen serve: error: {error}", file=sys.stderr)
        return error.code
    import jax.numpy as jnp
    import uvicorn

    from jaxgen import models
    from jaxgen.core.context import model_positions
    from jaxgen.serving.http_app import build_app
    from jaxgen.serving.request_body import DEFAULT_MAX_BODY_BYTES

    name = args.model or models.DEFAULT_MODEL
    try:
        model, params, tokenizer = models.load(
            name, dtype=jnp.float32 if args.dtype == "float32" else jnp.bfloat16)
    except (FileNotFoundError, ValueError, OSError) as error:
        print(f"jaxgen serve: error: cannot load model {name!r}: {error}", file=sys.stderr)
        return EXIT_MODEL
    if tokenizer is None:
        print(f"jaxgen serve: error: model {name!r} has no tokenizer.json", file=sys.stderr)
        return EXIT_MODEL
    positions = model_positions(model)
    max_len = args.max_len or min(positions or 2048, 2048)
    if positions is not None and max_len > positions:
        print(f"jaxgen serve: error: argument --max-len: must be in 2..{positions} (the model's "
              f"max_position_embeddings), got {max_len}", file=sys.stderr)
        return EXIT_USAGE
    try:
        app = build_app(model, params, tokenizer,
                        model_name=os.path.basename(name.rstrip("/")),
                        api_key=args.api_key or os.environ.get("JAXGEN_API_KEY"),
                        slots=args.slots, max_len=max_len, chunk_size=args.chunk_size,
                        max_waiting=args.max_waiting, warm_up_lengths=(1,),
                        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    except ValueError as error:  # settings the model or the memory cannot take
        print(f"jaxgen serve: error: {error} (--slots / --max-len)", file=sys.stderr)
        return EXIT_USAGE
    # uvicorn re-raises the signal it shut down on, to the handler it found (SIGTERM's
    # default kills the process: -15); a handler that does nothing keeps the documented 0
    previous = {sig: signal.signal(sig, lambda *_: None)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                    timeout_graceful_shutdown=args.grace)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


__all__ = ["build_parser", "main"]
