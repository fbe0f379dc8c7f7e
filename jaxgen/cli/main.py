"""The `jaxgen` command: stream an answer, chat, or run a JSONL batch.

    $ jaxgen "What is the capital of France?"             # streams, then a summary line
    $ jaxgen --chat                                         # interactive, history kept;
                                                            # a turn prefills its own tokens
    $ jaxgen --input prompts.jsonl --output out.jsonl       # batch work with a progress bar
    $ jaxgen --input prompts.jsonl --output out.jsonl --resume   # continue after a stop
    $ jaxgen --truncation left --input long.jsonl       # prompts past the context keep their end
    $ jaxgen --model ./hf-folder --do-sample --temperature 0.7 --seed 1 "Hi"
    $ jaxgen --assistant ./small-draft "Hi"     # assisted decoding; a draft with another
                                                # tokenizer runs universal assisted decoding
    $ jaxgen serve --port 8000                  # an OpenAI-compatible HTTP server
                                                # (jaxgen.cli.serve)
    $ jaxgen --speculative lookup "Hi"          # lookup | draft | early-exit | mtp |
                                                # mtp-drafter (lossless); the summary adds
                                                # the mean accepted drafts/round

A second run is fast: compiled programs and the converted default model are kept in a
per-user cache (jaxgen.cli.compile_cache; --no-cache turns it off). One answer of up to
STACKED_MAX_NEW_TOKENS runs the stacked layout (the fastest to compile and to load), longer
ones, --chat and batches the unstacked one (the fastest per token); --layout overrides.

With no --model the embedded default (SmolLM2-135M-Instruct) answers. Batch mode (checked
input, crash-safe output, --resume, Ctrl-C within one chunk) lives in jaxgen.cli.batch.

Errors are one line on stderr, never a traceback, with an exit code:
    0 success, 1 runtime error (e.g. NaN/inf logits), 2 usage (flags, --output equal to
    --input, an existing --output without --resume / --overwrite), 3 model, 4 input or output
    file (a bad record names file:line), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
Ctrl-C and SIGTERM stop the command within seconds wherever it is (jaxgen.cli.interrupts).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from jaxgen.cli.assisted import METHODS
from jaxgen.cli.batch import run_batch
from jaxgen.cli.batch_input import DEFAULT_MAX_RECORD_BYTES
from jaxgen.cli.batch_prompts import TRUNCATION_CHOICES
from jaxgen.cli.errors import (  # noqa: F401  (the codes are part of this module's interface)
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_MODEL,
    EXIT_RUNTIME,
    EXIT_USAGE,
    CliError,
)
from jaxgen.cli.interrupts import Interrupted, SignalGuard
from jaxgen.cli.layouts import (
    STACKED_MAX_NEW_TOKENS,
    choose_layout,
    params_for_layout,
    program_layout,
)
from jaxgen.cli.token_rate import tokens_per_second
from jaxgen.models.quantize import WEIGHT_FORMATS

INT32_MAX = 2**31 - 1


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise CliError(f"{message} (see jaxgen --help)", EXIT_USAGE)


def _bounded_int(low: int, high: int):
    """An argparse type: an integer in low..high (past int32 is a usage error, not a crash)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxgen", description="Generate text with a JAX-compiled decoder.")
    parser.add_argument("prompt", nargs="?", help="the prompt (read from stdin if omitted)")
    parser.add_argument("--model", default=None,
                        help="a Hugging Face checkpoint folder, a .gguf file or a known name "
                             "(default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--assistant", default=None, metavar="PATH",
                        help="a draft model (Hugging Face folder, .gguf file or known name) for "
                             "assisted decoding; one with another tokenizer runs universal "
                             "assisted decoding (same output, greedy or sampled)")
    parser.add_argument("--max-new-tokens", type=_bounded_int(1, INT32_MAX), default=256)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=_bounded_int(0, INT32_MAX), default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=_bounded_int(0, 2**32 - 1), default=0)
    parser.add_argument("--chat", action="store_true", help="interactive chat (stdin), history kept")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="send the raw prompt instead of wrapping it in the chat template")
    parser.add_argument("--input", help="JSONL file of {\"prompt\": ...} or {\"messages\": [...]}")
    parser.add_argument("--output", help="JSONL file to write (with --input; results appended "
                                         "as they finish, in input order, crash-safe)")
    parser.add_argument("--resume", action="store_true",
                        help="skip the records already in --output and continue")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an --output that already holds results")
    parser.add_argument("--batch-size", type=_bounded_int(1, INT32_MAX), default=8,
                        help="rows decoded together with --input (continuous batching: "
                             "a finished row's slot takes the next record)")
    parser.add_argument("--max-record-bytes", type=_bounded_int(1, 2**40),
                        default=None, metavar="N",
                        help="the longest --input line accepted, in bytes (default "
                             f"{DEFAULT_MAX_RECORD_BYTES}, 16 MiB); a longer one is an error "
                             "naming its file:line")
    parser.add_argument("--truncation", choices=TRUNCATION_CHOICES, default="none",
                        help="a prompt that does not fit the model's positions together with "
                             "--max-new-tokens: none (an error naming it, the default) or left "
                             "(keep its last tokens, as transformers' pipelines with "
                             "truncation_side='left')")
    parser.add_argument("--no-stream", action="store_true", help="print the answer at the end")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="float",
                        help="float (--dtype), int8 (weight-only int8 matrices) or gguf (a "
                             "GGUF model's own Q4_0 / Q4_1 / Q8_0 blocks kept as integers)")
    parser.add_argument("--quiet", action="store_true", help="no summary line")
    parser.add_argument("--no-cache", "--no-compile-cache", dest="no_cache",
                        action="store_true",
                        help="keep nothing on disk between runs: no compiled programs, no "
                             "converted model (default cache: $JAXGEN_CACHE_DIR, else "
                             "~/.cache/jaxgen)")
    parser.add_argument("--layout", choices=("auto", "stacked", "unstacked"), default="auto",
                        help="weights layout: stacked compiles and loads fastest, unstacked "
                             "decodes fastest (auto: stacked up to "
                             f"{STACKED_MAX_NEW_TOKENS} new tokens, else unstacked; "
                             "unstacked for --input and --chat)")
    parser.add_argument("--speculative", choices=sorted(METHODS), default=None,
                        metavar="METHOD",
                        help="assisted decoding, same answer: " + ", ".join(sorted(METHODS))
                             + " (lookup: prompt n-grams; draft: --assistant or the shipped "
                               "draft; early-exit: the first --exit-layer layers draft)")
    parser.add_argument("--draft-tokens", type=_bounded_int(1, 1024), default=None,
                        metavar="K", help="draft length per round with --speculative")
    parser.add_argument("--exit-layer", type=_bounded_int(1, INT32_MAX), default=None,
                        metavar="E", help="--speculative early-exit: draft with layers "
                                          "[0, E) (default: a trained exit layer, else half)")
    parser.add_argument("--verbose", action="store_true",
                        help="a second summary line: load time and what came from the caches")
    return parser


# The GenerationConfig field each flag sets: a config error names the flag.
FLAG_OF_FIELD = {"max_new_tokens": "--max-new-tokens", "do_sample": "--do-sample",
                 "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                 "repetition_penalty": "--repetition-penalty",
                 "num_assistant_tokens": "--draft-tokens",
                 "prompt_lookup_num_tokens": "--draft-tokens",
                 "assistant_early_exit": "--exit-layer"}


def flag_error(error: Exception) -> CliError:
    """A GenerationConfig error as a usage error that names the flag (exit 2).

    >>> str(flag_error(ValueError("`top_p` must be a float in (0, 1], got 2.0")))
    '--top-p: `top_p` must be a float in (0, 1], got 2.0'
    """
    text = str(error)
    for field, flag in FLAG_OF_FIELD.items():
        if f"`{field}`" in text or text.startswith(f"{field}=") or f" {field}=" in text:
            return CliError(f"{flag}: {text}", EXIT_USAGE)
    return CliError(text, EXIT_USAGE)


def _sampling_fields(args) -> dict:
    fields = {"max_new_tokens": args.max_new_tokens}
    if args.do_sample:
        fields["do_sample"] = True
    for name in ("temperature", "top_k", "top_p", "repetition_penalty"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    return fields


def check_settings(args) -> None:
    """The generation flags, checked before the model loads (GenerationConfig's own checks;
    those that need the model follow in make_config)."""
    from jaxgen.config.generation import GenerationConfig

    try:
        GenerationConfig(**_sampling_fields(args))
    except ValueError as error:
        raise flag_error(error) from None


def _overrides(args, model) -> dict:
    from jaxgen.cli.assisted import config_fields

    if args.exit_layer is not None:
        layers = int(getattr(model.config, "num_layers", 0) or 0)
        if layers and not 1 <= args.exit_layer <= layers:
            raise CliError(f"--exit-layer {args.exit_layer}: the model has {layers} layers "
                           f"(allowed: 1..{layers})", EXIT_USAGE)
    fields = _sampling_fields(args)
    fields.update(config_fields(args.speculative, draft_tokens=args.draft_tokens,
                                exit_layer=args.exit_layer, model=model))
    return fields


def load_model(args, unstack: bool = True):
    """(model, params, tokenizer); params per layer when the run's layout is unstacked
    (unstack=False leaves that to the caller: batch mode checks every prompt first)."""
    import jax.numpy as jnp

    from jaxgen import models
    from jaxgen.cli.compile_cache import model_cache_dir

    name = args.model or models.DEFAULT_MODEL
    started = time.perf_counter()
    try:
        model, params, tokenizer = models.load(
            name, dtype=jnp.float32 if args.dtype == "float32" else jnp.bfloat16,
            cache_dir=None if args.no_cache else model_cache_dir(), weights=args.weights)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise CliError(f"cannot load model {name!r}: {error}", EXIT_MODEL) from None
    if tokenizer is None:
        raise CliError(f"model {name!r} has no tokenizer.json: the command line needs text",
                       EXIT_MODEL)
    if unstack:
        params = params_for_layout(model, params, args)
    args.load_s = time.perf_counter() - started
    return model, params, tokenizer


def assistant_to_load(args) -> str | None:
    """The assistant's name or path: --assistant, or the one a --speculative method ships
    with; a usage error when the method needs one that is not there."""
    from jaxgen.cli.assisted import assistant_name
    from jaxgen.models.registry import DEFAULT_MODEL

    try:
        return assistant_name(args.speculative, assistant=args.assistant,
                              model_name=args.model or DEFAULT_MODEL, default_model=DEFAULT_MODEL)
    except ValueError as error:
        raise CliError(str(error), EXIT_USAGE) from None


def load_assistant(args, model):
    """(model, params, tokenizer) of the assistant (--assistant, or the draft
    --speculative draft ships with), or None without one."""
    import jax.numpy as jnp

    from jaxgen import models

    name = assistant_to_load(args)
    if not name:
        return None
    try:
        draft, params, tokenizer = models.load(
            name, dtype=jnp.float32 if args.dtype == "float32" else jnp.bfloat16)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise CliError(f"cannot load assistant {name!r}: {error}", EXIT_MODEL) from None
    if tokenizer is None and int(draft.vocab_size) != int(model.vocab_size):
        raise CliError(f"assistant {name!r} has another vocabulary and no "
                       f"tokenizer.json: universal assisted decoding needs its tokenizer",
                       EXIT_MODEL)
    if isinstance(draft, models.Llama):  # drafters of other kinds keep their own layout
        params = models.unstack_layers(draft, params)
    return draft, params, tokenizer


def make_config(model, args):
    from jaxgen.api.generate import default_config

    try:
        return default_config(model, None, **_overrides(args, model))
    except ValueError as error:
        raise flag_error(error) from None


def seed_key(seed: int):
    """jax.random.key(seed), built on the host where the default generator is threefry (no
    program to compile or read back: a warm run's fixed cost).

    >>> import jax
    >>> bool((jax.random.key_data(seed_key(2**32 - 1))
    ...       == jax.random.key_data(jax.random.key(2**32 - 1))).all())
    True
    """
    import jax
    import numpy as np

    if jax.config.jax_default_prng_impl != "threefry2x32":
        return jax.random.key(seed)
    return jax.random.wrap_key_data(np.array([0, seed], np.uint32))  # [2]: threefry's seed


def prompt_rules(model, args):
    """How prompts must fit the model (jaxgen.cli.batch_prompts): its positions, the flags."""
    from jaxgen.cli.batch_prompts import PromptRules
    from jaxgen.core.context import model_positions

    return PromptRules(use_template=False, no_template_flag=args.no_chat_template,
                       vocab_size=int(model.vocab_size), max_positions=model_positions(model),
                       max_new_tokens=int(args.max_new_tokens),
                       truncation=None if args.truncation == "none" else args.truncation)


def _fit_prompt(row: list[int], model, args) -> list[int]:
    """The prompt's ids when they fit the model's positions with --max-new-tokens (the last
    ones with --truncation left); a usage error naming the numbers otherwise."""
    from jaxgen.cli.batch_prompts import fit_context

    fitted, problem = fit_context(row, prompt_rules(model, args))
    if problem:
        if args.chat:  # the history is the prompt; /reset empties it
            problem = problem.replace("the prompt (", "the conversation (", 1).replace(
                "shorten the prompt", "/reset the history", 1)
        raise CliError(problem, EXIT_USAGE)
    return fitted


def _rows(tokenizer, prompts, use_template: bool) -> list[list[int]]:
    from jaxgen.api.text import encode_prompts

    return encode_prompts(tokenizer, prompts, chat=use_template)


def answer_streaming(model, params, tokenizer, cfg, messages_or_prompt, args, clock,
                     assistant=None, turns: dict | None = None) -> str:
    """Streams one answer to stdout; returns its text. Prints the summary on stderr.
    turns: --chat's holder of the previous answer's output ("out"): the new turn continues
    its cache (jaxgen.core.continuation.continue_to), so it prefills only its own tokens."""
    import numpy as np

    import jaxgen
    from jaxgen.drivers.chunked import ChunkTimings
    from jaxgen.drivers.streamers import TextStreamer

    use_template = not args.no_chat_template and tokenizer.chat_template is not None
    [row] = _rows(tokenizer, [messages_or_prompt], use_template)
    row = _fit_prompt(row, model, args)
    pieces: list[str] = []

    class Printer(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            pieces.append(text)
            if not args.no_stream:
                print(text, end="" if not stream_end else "\n", flush=True)

    from jaxgen.api.text import InvalidLogitsError, check_logits_valid

    timings = ChunkTimings()
    compiled_before = clock.compile_s
    state = _continued(turns, row, cfg, assistant)
    if state is None:
        state = jaxgen.init_state(model, [row], cfg, seed_key(args.seed))
    assisted = {}
    if assistant is not None:
        draft, draft_params, draft_tokenizer = assistant
        assisted = dict(assistant_model=(draft, draft_params), tokenizer=tokenizer,
                        assistant_tokenizer=draft_tokenizer)
    window_start, window_compile = time.perf_counter(), clock.compile_s
    out = jaxgen.generate(params, state, cfg, streamer=Printer(tokenizer, skip_prompt=True,
                                                               skip_special_tokens=True),
                          timings=timings, layout=program_layout(args), **assisted)
    window_s = time.perf_counter() - window_start
    window_compile_s = clock.compile_s - window_compile
    if turns is not None:
        turns["out"] = out if assistant is None else None
    try:
        check_logits_valid(out.stop_reason, 1)
    except InvalidLogitsError:
        raise CliError("the model produced NaN/inf logits for this prompt (stop reason "
                       "'invalid_logits'); its output is garbage: check the weights (or try "
                       "--dtype float32)", EXIT_RUNTIME) from None
    text = "".join(pieces)
    if args.no_stream:
        print(text.strip())
    new_tokens = int(np.asarray(out.lengths)[0] - np.asarray(out.prompt_lengths)[0])
    if not args.quiet:
        compile_s = clock.compile_s - compiled_before
        rate = tokens_per_second(new_tokens, window_s, window_compile_s)  # the same window
        accepted = ""
        if out.speculative is not None:
            accepted = f", {float(out.speculative.mean_accepted[0]):.2f} drafts accepted/round"
        print(f"[{new_tokens} new tokens, {rate:.1f} tokens/s, first token "
              f"{timings.first_token_s:.2f}s, compile {compile_s:.1f}s{accepted}]",
              file=sys.stderr)
        if args.verbose:
            print(f"[load {getattr(args, 'load_s', 0.0):.2f}s ({choose_layout(args)} layout), "
                  f"{clock.summary()}]", file=sys.stderr)
    return text


def _continued(turns: dict | None, row: list[int], cfg, assistant):
    """--chat: the state continuing the previous answer's output towards `row` (the whole
    conversation's ids), or None (the first turn, after /reset, with an assistant, or when
    the previous cache cannot be continued: the turn then runs from scratch)."""
    previous = None if turns is None else turns.pop("out", None)
    if previous is None or assistant is not None:
        return None
    from jaxgen.core.continuation import continue_to

    try:
        return continue_to(previous, [row], cfg)
    except ValueError:
        return None


def run_chat(model, params, tokenizer, cfg, args, clock, assistant=None) -> int:
    if tokenizer.chat_template is None:
        raise CliError("--chat needs a model with a chat template", EXIT_MODEL)
    history: list[dict] = []
    turns: dict = {}  # the previous answer's output, continued by the next turn
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        user = line.strip()
        if not user:
            continue
        if user in ("/exit", "/quit"):
            break
        if user == "/reset":
            history.clear()
            turns.clear()
            continue
        history.append({"role": "user", "content": user})
        reply = answer_streaming(model, params, tokenizer, cfg, list(history), args, clock,
                                 assistant, turns)
        history.append({"role": "assistant", "content": reply.strip()})
    return 0


def check_usage(args) -> None:
    """Flag combinations and values refused before anything loads (exit 2)."""
    from jaxgen.cli.assisted import check_flags

    try:
        check_flags(args.speculative, assistant=args.assistant, exit_layer=args.exit_layer)
    except ValueError as error:
        raise CliError(str(error), EXIT_USAGE) from None
    if args.draft_tokens is not None and not args.speculative:
        raise CliError("--draft-tokens needs --speculative", EXIT_USAGE)
    for flag in ("output", "resume", "overwrite", "max_record_bytes"):
        if getattr(args, flag) not in (None, False) and not args.input:
            raise CliError(f"--{flag.replace('_', '-')} needs --input", EXIT_USAGE)
    if args.chat and (args.input or args.prompt):
        raise CliError("--chat reads turns from stdin: drop the prompt / --input", EXIT_USAGE)
    if args.input:
        for flag in ("assistant", "speculative"):
            if getattr(args, flag):
                raise CliError(f"--{flag} is not supported with --input (batch mode) yet; "
                               f"drop one of them", EXIT_USAGE)
        if args.prompt is not None:
            raise CliError("--input reads the prompts from the file: drop the prompt",
                           EXIT_USAGE)
    check_settings(args)
    program_layout(args)  # a bad $JAXGEN_LAYER_LAYOUT
    if not args.input:
        assistant_to_load(args)


def run(args, guard: SignalGuard | None = None) -> int:
    from jaxgen.cli.batch_prompts import check_room
    from jaxgen.cli.compile_cache import (
        CacheStats,
        enable_compile_cache,
        prepare_kernels,
    )

    check_usage(args)
    try:  # a bad $JAXGEN_CPU_KERNELS before anything loads; the kernels build meanwhile
        prepare_kernels(no_cache=args.no_cache)
    except ValueError as error:
        raise CliError(str(error), EXIT_USAGE) from None
    if not args.no_cache:
        enable_compile_cache()
    if args.input:
        if args.max_record_bytes is None:
            args.max_record_bytes = DEFAULT_MAX_RECORD_BYTES
        return run_batch(args, load_model, make_config, guard)
    clock = CacheStats()
    model, params, tokenizer = load_model(args, unstack=False)
    cfg = make_config(model, args)
    check_room(prompt_rules(model, args))
    params = params_for_layout(model, params, args)  # compiles: after the checks
    assistant = load_assistant(args, model)
    if args.chat:
        return run_chat(model, params, tokenizer, cfg, args, clock, assistant)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise CliError("empty prompt", EXIT_USAGE)
    answer_streaming(model, params, tokenizer, cfg, prompt, args, clock, assistant)
    return 0


def _one_line(text: str) -> str:
    """Error text on one line (XLA and template errors span several)."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["serve"]:  # `jaxgen serve`: its own flags; uvicorn owns the signals
        from jaxgen.cli.serve import main as serve

        return serve(words[1:])
    guard = SignalGuard()
    try:
        with guard:  # Ctrl-C / SIGTERM: exit 130 / 143 within seconds, one line
            if argv is None and len(sys.argv) == 1 and sys.stdin.isatty():
                build_parser().print_help()
                return EXIT_USAGE
            args = build_parser().parse_args(argv)
            return run(args, guard)
    except Interrupted as stop:
        print(f"jaxgen: error: {stop}", file=sys.stderr)
        return stop.code
    except CliError as error:
        print(f"jaxgen: error: {_one_line(error)}", file=sys.stderr)
        return error.code
    except KeyboardInterrupt:
        print("jaxgen: error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as error:  # one line, never a traceback
        print(f"jaxgen: error: {type(error).__name__}: {_one_line(error)}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        stored = sys.modules.get("jaxgen.runtime.executable_cache")
        if stored is not None:  # in-process callers (tests) get plain jit calls back
            stored.disable()
        if argv is None:  # the command: the process exits next. Frozen objects are not
            gc.freeze()   # traversed by the collections at exit (~0.4 CPU-s less, measured)


if __name__ == "__main__":
    sys.exit(main())
