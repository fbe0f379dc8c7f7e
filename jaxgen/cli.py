"""The `jaxgen` command: answer a prompt with a model (the embedded default if none named).

    $ jaxgen "What is the capital of France?"
    $ jaxgen --model ./my-hf-folder --max-new-tokens 64 --do-sample --temperature 0.7 "Hi"

Errors are one clear line on stderr and a non-zero exit code, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

EXIT_USAGE, EXIT_MODEL, EXIT_RUNTIME = 2, 3, 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxgen", description="Generate text with a JAX-compiled decoder.")
    parser.add_argument("prompt", nargs="?", help="the prompt (read from stdin if omitted)")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face checkpoint folder, a .gguf file, or a known name "
                             "(default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-chat", action="store_true",
                        help="send the raw prompt instead of wrapping it in the chat template")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--quiet", action="store_true", help="print only the answer")
    return parser


def _overrides(args) -> dict:
    fields = {"max_new_tokens": args.max_new_tokens}
    if args.do_sample:
        fields["do_sample"] = True
    for name in ("temperature", "top_k", "top_p"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    return fields


def run(args) -> int:
    import jax
    import jax.numpy as jnp

    import jaxgen
    from jaxgen import models
    from jaxgen.generate import default_config

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        print("jaxgen: error: empty prompt", file=sys.stderr)
        return EXIT_USAGE
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    try:
        model, params, tokenizer = models.load(args.model or models.DEFAULT_MODEL, dtype=dtype)
    except (FileNotFoundError, ValueError, OSError) as error:
        print(f"jaxgen: error: cannot load model: {error}", file=sys.stderr)
        return EXIT_MODEL
    try:
        cfg = default_config(model, None, **_overrides(args))
    except ValueError as error:
        print(f"jaxgen: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    chat = not args.no_chat and getattr(tokenizer, "chat_template", None) is not None
    start = time.perf_counter()
    try:
        [answer] = jaxgen.generate_text(model, params, tokenizer, [prompt], cfg, chat=chat,
                                        key=jax.random.key(args.seed))
    except ValueError as error:
        print(f"jaxgen: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    elapsed = time.perf_counter() - start
    print(answer.strip())
    if not args.quiet:
        print(f"[{args.model or models.DEFAULT_MODEL}: {elapsed:.1f}s including compilation]",
              file=sys.stderr)
    return 0


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # one line, never a traceback
        print(f"jaxgen: error: {type(error).__name__}: {error}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
