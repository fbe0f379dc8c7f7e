"""Batch mode of the `jaxgen` command: a JSONL file of prompts in, a JSONL file of results out.

    $ jaxgen --input prompts.jsonl --output out.jsonl            # a fresh run
    $ jaxgen --input prompts.jsonl --output out.jsonl --resume   # continue after a stop

What a run that lasts hours can rely on (README, "Batch mode guarantees"):

  * Memory does not grow with the file: the input is read as a stream, three times. The
    first pass (jaxgen.cli.batch_input) checks every record (size, UTF-8, JSON, fields and
    types, Unicode text, duplicate ids) and keeps 16 bytes and a line number per record;
    the second (after the model loads, before anything compiles; jaxgen.cli.batch_prompts)
    builds and checks every prompt's tokens (vocabulary, the model's context, or
    --truncation left); the third streams the records into a continuous-batching engine
    (jaxgen.serving.Engine, --batch-size slots: a short answer frees its slot for the next
    record instead of waiting for its batch's longest), at most WINDOW_PER_SLOT x slots
    records in flight (submitted, not yet written; the engine's waiting queue is bounded
    alike). An error names `file:line` and exits 4.
  * `--output` is never the input file (also through a symlink or a hard link), and an output
    that already holds results is refused unless `--resume` (continue) or `--overwrite`.
  * One run at a time per `--output` (an exclusive `flock` while it runs).
  * Results are written in input order: each finished record waits (in the bounded window)
    for the ones before it, and the ready ones are appended whole, in one `write`, then
    flushed and fsync'ed: a crash, SIGKILL or Ctrl-C leaves every finished record intact and
    the file valid JSONL. `--resume` drops a
    partial last line, should one ever be left (an interrupted write, a full disk).
  * Every result carries its key: the record's "id" when it has one, else "input_line" (its
    1-based line in the input). `--resume` skips the records whose key is already in
    `--output`. A record's tokens do not depend on its slot or its neighbours (the engine
    gives each request what a solo generate_ids call gives), so a resumed greedy run writes
    what an uninterrupted one writes, and what the fixed batches of earlier versions wrote.
    Sampling keys are per record (seed folded with the record's index, the request's own
    row key), so they do not depend on batching either.
  * The run record next to the output (jaxgen.cli.run_record: settings, model, a digest per
    input record) is written atomically before the first result; `--resume` refuses (exit 2)
    an edited input, other settings or another model, saying what differs.
  * Ctrl-C (SIGINT) or SIGTERM stops generation within about one chunk (the engine is
    closed with cancel=True: its requests end at the next chunk boundary), or within seconds
    during a long compiled call (the watchdog of jaxgen.cli.interrupts); the records still in
    flight are not written (--resume runs them); exit 130 (143 for SIGTERM). A second Ctrl-C
    aborts at once (the file stays valid: writes are whole records).
"""
from __future__ import annotations

import contextlib
import sys
import time

import numpy as np

from jaxgen.cli.batch_input import (  # noqa: F401  (Record and describe_key are re-exported)
    DEFAULT_MAX_RECORD_BYTES,
    InputFile,
    Record,
    describe_key,
    iter_records,
    scan_input,
)
from jaxgen.cli.batch_output import OutputFile, StdoutSink
from jaxgen.cli.batch_prompts import (
    ENCODE_AT_ONCE,
    PromptRules,
    check_prompts,
    check_room,
    encode_batch,
)
from jaxgen.cli.errors import (  # noqa: F401  (the codes are re-exported)
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_MODEL,
    EXIT_RUNTIME,
    EXIT_TERMINATED,
    EXIT_USAGE,
    CliError,
)
from jaxgen.cli.interrupts import SignalGuard
from jaxgen.cli.run_record import (
    RunRecord,
    model_fingerprint,
    read_record,
    record_path,
    refuse_differences,
    write_record,
)
from jaxgen.cli.token_rate import tokens_per_second

WINDOW_PER_SLOT = 4  # records in flight per slot: waiting, decoding, or done out of order
CHUNK_STEPS = 8  # decode steps between the engine's host steps: how soon a stop is seen
POLL_S = 0.05  # how long the writer waits for the next result before looking again


def check_args(args) -> None:
    if args.resume and args.overwrite:
        raise CliError("--resume and --overwrite exclude each other", EXIT_USAGE)
    if (args.resume or args.overwrite) and not args.output:
        raise CliError(f"{'--resume' if args.resume else '--overwrite'} needs --output",
                       EXIT_USAGE)


def _result(record: Record, tokenizer, new: list[int], reason: str) -> str:
    """The result line of a record: its input object, input_line, completion, new_tokens,
    stop_reason (jaxgen.stopping.STOP_REASONS' name)."""
    import json

    result = dict(record.data)
    result["input_line"] = record.line
    result["completion"] = tokenizer.decode(new, skip_special_tokens=True)
    result["new_tokens"] = len(new)
    result["stop_reason"] = reason
    return json.dumps(result, ensure_ascii=False) + "\n"


class _Progress:
    """How many records are in the output: what an interruption's message says."""

    def __init__(self, args, total: int, written: int):
        self.args, self.total, self.written = args, total, written

    def describe(self) -> str:
        if self.args.output:
            return (f"{self.written} of {self.total} records are in {self.args.output}; run the "
                    f"same command with --resume to continue")
        return f"after {self.written} of {self.total} records"


def run_batch(args, load_model, make_config, guard: SignalGuard | None = None) -> int:
    """The batch run (see the module docstring).

    load_model(args, unstack=False) -> (model, params, tokenizer) and make_config(model,
    args) -> config come from jaxgen.cli.main (passed in, so that this module does not
    import it); `guard` is the command's SignalGuard (None: one for this run).
    """
    check_args(args)
    max_record = getattr(args, "max_record_bytes", None) or DEFAULT_MAX_RECORD_BYTES
    source = InputFile(args.input, max_record)
    try:
        index = scan_input(args.input, source=source)
        return _run(args, source, index, load_model, make_config, guard)
    finally:
        source.close()


def _run(args, source, index, load_model, make_config, guard) -> int:
    sink, done_keys, earlier = StdoutSink(), np.zeros(0, np.uint64), None
    this_run = RunRecord.start(args, index.digests)
    if args.output:
        sink = OutputFile(args.output)
        sink.check(args.input, args.resume, args.overwrite)  # refuse early, read-only
        sink.open()
    try:
        if args.output:  # again under the lock: what is there now is what we resume from
            if sink.check(args.input, args.resume, args.overwrite):
                earlier = read_record(record_path(args.output))
                line_cap = 2 * source.max_record_bytes + 2**20  # a record, and its answer
                try:
                    done_keys = sink.scan(index, args.input, line_cap)
                except CliError:  # results of unknown keys: say first what differs, if known
                    if earlier is not None:
                        refuse_differences(args.output, earlier, this_run, index.lines)
                    raise
            if not sink.holds_results():  # nothing finished: the record is simply replaced
                earlier = None
            else:
                if earlier is None:
                    raise CliError(
                        f"--resume: {args.output} has no run record "
                        f"({record_path(args.output)}; an older jaxgen wrote it, or it was "
                        f"removed), so jaxgen cannot check that this run continues it with "
                        f"the same input and settings; start again with --overwrite",
                        EXIT_USAGE)
                refuse_differences(args.output, earlier, this_run, index.lines)
        done = np.isin(index.keys, done_keys)  # [N] bool: records already in the output
        if done.all():
            print(f"jaxgen: nothing to do: all {len(index)} records of {args.input} are "
                  f"already in {args.output}", file=sys.stderr)
            return 0
        with contextlib.nullcontext(guard) if guard is not None else SignalGuard() as active:
            return _generate_all(args, source, index, done, sink, earlier, this_run,
                                 load_model, make_config, active)
    finally:
        sink.close()


def _generate_all(args, source, index, done, sink, earlier, this_run, load_model,
                  make_config, guard) -> int:
    """Loads the model, checks every remaining prompt, writes the run record, generates."""
    from jaxgen.cli.layouts import params_for_layout, program_layout
    from jaxgen.core.context import model_positions

    layout = program_layout(args)
    model, params, tokenizer = load_model(args, unstack=False)
    if isinstance(sink, OutputFile):
        this_run = this_run.with_fingerprint(model_fingerprint(model, tokenizer,
                                                               this_run.model))
        if earlier is not None:
            refuse_differences(args.output, earlier, this_run, index.lines)
    cfg = make_config(model, args)
    rules = PromptRules(
        use_template=not args.no_chat_template and tokenizer.chat_template is not None,
        no_template_flag=args.no_chat_template, vocab_size=int(model.vocab_size),
        max_positions=model_positions(model), max_new_tokens=int(args.max_new_tokens),
        truncation=None if getattr(args, "truncation", "none") == "none" else args.truncation)
    check_room(rules)
    remaining = (r for r in iter_records(args.input, index, source) if not done[r.index])
    found = check_prompts(tokenizer, remaining, rules, args.input)
    if found.truncated and not args.quiet:
        print(f"jaxgen: note: {found.truncated} prompt{'s' if found.truncated > 1 else ''} "
              f"longer than the model's {rules.max_positions} positions less --max-new-tokens "
              f"{rules.max_new_tokens} keep their last tokens (--truncation left; the first "
              f"is {args.input}:{found.first_truncated})", file=sys.stderr)
    params = params_for_layout(model, params, args)  # compiles: once every record is checked
    if isinstance(sink, OutputFile):
        note = sink.prepare(args.overwrite)
        if note and not args.quiet:
            print(f"jaxgen: note: {note}", file=sys.stderr)
        if sink.regular and earlier != this_run:  # before the first result (resume needs
            write_record(args.output, this_run)  # a regular file anyway)
            sink.companion = record_path(args.output)
    return _generate_batches(args, source, index, done, sink, model, params, tokenizer, cfg,
                             rules, layout, guard, found.longest)


def _encoded(records, done: np.ndarray, tokenizer, rules, path: str, group: int):
    """(record, prompt ids) of every remaining record, in input order, tokenized `group` at
    a time (the tokenizer's batch call), lazily: the caller takes what it can submit."""
    waiting = []
    for record in records:
        if done[record.index]:
            continue
        waiting.append(record)
        if len(waiting) == group:
            yield from zip(waiting, encode_batch(tokenizer, waiting, rules, path))
            waiting = []
    if waiting:
        yield from zip(waiting, encode_batch(tokenizer, waiting, rules, path))


def _completion(handle):
    """The handle's Completion; the engine thread's own error raised as it is (one line)."""
    from jaxgen.serving import EngineError

    try:
        return handle.result()
    except EngineError as error:
        raise (error.__cause__ or error) from None


def _generate_batches(args, source, index, done, sink, model, params, tokenizer, cfg, rules,
                      layout, guard, longest: int) -> int:
    """Streams the remaining records through a continuous-batching Engine (slots =
    --batch-size) and appends each result once every earlier one is written."""
    import collections

    import jax
    from tqdm import tqdm

    from jaxgen import stopping
    from jaxgen.serving import Engine, EngineError
    from jaxgen.serving.admission import slot_length

    invalid = stopping.STOP_REASONS[stopping.INVALID_LOGITS]
    total, already = len(index), int(done.sum())
    progress = _Progress(args, total, already)
    guard.describe = progress.describe
    slots = max(1, min(int(args.batch_size), total - already))
    window = WINDOW_PER_SLOT * slots  # records in flight: submitted, not yet written
    try:
        engine = Engine(model, params, cfg, slots=slots,
                        max_len=slot_length(model, longest, int(args.max_new_tokens)),
                        chunk_size=CHUNK_STEPS, max_waiting=window, layout=layout)
    except ValueError as error:
        raise CliError(f"batch mode: {error}", EXIT_USAGE) from None
    base_key = jax.random.key(args.seed)
    sampled = bool(cfg.do_sample)
    feed = _encoded(iter_records(args.input, index, source), done, tokenizer, rules,
                    args.input, min(ENCODE_AT_ONCE, window))
    in_flight: collections.deque = collections.deque()  # (record, handle), input order
    more, total_new, start = True, 0, time.perf_counter()
    try:
        with guard.soft(), tqdm(total=total, initial=already, unit="prompt", file=sys.stderr,
                                disable=args.quiet) as bar:
            while not guard.event.is_set():
                while more and len(in_flight) < window:
                    item = next(feed, None)
                    if item is None:
                        more = False
                        break
                    record, row = item
                    key = jax.random.fold_in(base_key, record.index)[None] if sampled else None
                    in_flight.append((record, engine.submit(row, key=key)))
                if not in_flight:
                    break
                if not in_flight[0][1].done():  # the next result to write: wait a moment
                    with contextlib.suppress(TimeoutError, EngineError):
                        in_flight[0][1].result(timeout=POLL_S)  # failed: raised below, in order
                    continue
                lines, bad = [], None
                while in_flight and in_flight[0][1].done():
                    record, handle = in_flight.popleft()
                    completion = _completion(handle)
                    if completion.status != "finished":  # the engine was closed under us
                        raise CliError(f"{args.input}:{record.line}: the engine ended this "
                                       f"record ({completion.status}); {progress.written} "
                                       f"finished records are kept", EXIT_RUNTIME)
                    if completion.stop_reason == invalid:
                        bad = record
                        break
                    total_new += len(completion.new_ids)
                    lines.append(_result(record, tokenizer, completion.new_ids,
                                         completion.stop_reason))
                if lines:
                    with guard.writing():
                        sink.append(lines)
                    progress.written += len(lines)
                    bar.update(len(lines))
                if bad is not None:
                    raise CliError(f"{args.input}:{bad.line}: the model produced NaN/inf "
                                   f"logits for this prompt (stop reason 'invalid_logits'); "
                                   f"check the weights (or try --dtype float32); "
                                   f"{progress.written} finished records are kept",
                                   EXIT_RUNTIME)
    finally:  # the interrupted requests end at the next chunk boundary, unwritten
        engine.close(cancel=bool(in_flight))
    if guard.event.is_set() and progress.written < total:
        word = "terminated" if guard.code == EXIT_TERMINATED else "interrupted"
        raise CliError(f"{word}: {progress.describe()}", guard.code or EXIT_INTERRUPTED)
    if not args.quiet:
        elapsed = time.perf_counter() - start
        rate = tokens_per_second(total_new, elapsed, 0.0)
        print(f"[{progress.written - already} prompts, {total_new} new tokens, "
              f"{rate:.1f} tokens/s]", file=sys.stderr)
    return 0
