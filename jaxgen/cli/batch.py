"""Batch mode of the `jaxgen` command: a JSONL file of prompts in, a JSONL file of results out.

    $ jaxgen --input prompts.jsonl --output out.jsonl            # a fresh run
    $ jaxgen --input prompts.jsonl --output out.jsonl --resume   # continue after a stop

What a run that lasts hours can rely on (README, "Batch mode guarantees"):

  * Every record is checked (JSON, fields, types, duplicate ids, then the tokenized prompt)
    before the first model call; an error names `file:line` and exits 4.
  * `--output` is never the input file (also through a symlink or a hard link), and an output
    that already holds results is refused unless `--resume` (continue) or `--overwrite`.
  * One run at a time per `--output` (an exclusive `flock` while it runs).
  * Each batch is appended in one `write`, then flushed and fsync'ed: a crash, SIGKILL or
    Ctrl-C leaves every finished record intact and the file valid JSONL. `--resume` drops a
    partial last line, should one ever be left (an interrupted write, a full disk).
  * Every result carries its key: the record's "id" when it has one, else "input_line" (its
    1-based line in the input). `--resume` skips the records whose key is already in
    `--output`; batches keep their boundaries in the input, so a resumed greedy run writes
    what an uninterrupted one writes. Sampling keys are per record (seed folded with the
    record's index), so they do not depend on batching either.
  * Ctrl-C (SIGINT) or SIGTERM stops generation within about one chunk (a `stop_event` on
    the chunked driver); the interrupted batch is not written; exit 130 (143 for SIGTERM).
    A second Ctrl-C aborts at once (the file stays valid: writes are whole batches).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import stat
import sys
import threading
import time

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

from jaxgen.cli.errors import (  # noqa: F401  (the codes are re-exported)
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_MODEL,
    EXIT_RUNTIME,
    EXIT_TERMINATED,
    EXIT_USAGE,
    CliError,
)

RESULT_FIELDS = ("input_line", "completion", "new_tokens", "stop_reason")


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), "null")


@dataclasses.dataclass(frozen=True)
class Record:
    """One input record: its line (1-based), index among the records, key and prompt."""

    line: int
    index: int
    key: tuple  # ("id", json of the id) or ("line", line)
    data: dict  # the input object, copied into the result
    prompt: object  # a string, or a list of {"role", "content"} messages


def describe_key(key: tuple) -> str:
    return f"id {key[1]}" if key[0] == "id" else f"input line {key[1]}"


def _check_messages(messages) -> str | None:
    if not isinstance(messages, list):
        return f"'messages' must be an array, got {_json_type(messages)}"
    if not messages:
        return "'messages' is empty"
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            return f"message {number} must be an object, got {_json_type(message)}"
        for field in ("role", "content"):
            if field not in message:
                return f"message {number} has no {field!r}"
            if not isinstance(message[field], str):
                return (f"message {number}: {field!r} must be a string, got "
                        f"{_json_type(message[field])}")
        if not message["role"].strip():
            return f"message {number}: 'role' is empty"
    return None


def _check_record(value) -> tuple[dict | None, str | None]:
    """(record object, None) or (None, what is wrong), for one parsed JSON line."""
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        return None, (f"expected an object with \"prompt\" or \"messages\" (or a string), got "
                      f"{_json_type(value)}")
    if "prompt" in value and "messages" in value:
        return None, "give either \"prompt\" or \"messages\", not both"
    if "prompt" in value:
        prompt = value["prompt"]
        if not isinstance(prompt, str):
            return None, f"'prompt' must be a string, got {_json_type(prompt)}"
        if not prompt.strip():
            return None, "prompt is empty"
    elif "messages" in value:
        problem = _check_messages(value["messages"])
        if problem:
            return None, problem
    else:
        return None, "expected an object with \"prompt\" or \"messages\""
    if "id" in value:
        ident = value["id"]
        if isinstance(ident, bool) or not isinstance(ident, (str, int)):
            return None, f"'id' must be a string or an integer, got {_json_type(ident)}"
    return value, None


def _raise_first(path: str, problems: list[tuple[int, str]]) -> None:
    """One line: the first problem, and how many more there are."""
    if not problems:
        return
    line, message = problems[0]
    more = ""
    if len(problems) > 1:
        others = ", ".join(str(n) for n, _ in problems[1:6])
        more = (f" (and {len(problems) - 1} more bad record"
                f"{'s' if len(problems) > 2 else ''}: line{'s' if len(problems) > 2 else ''} "
                f"{others}{', ...' if len(problems) > 6 else ''})")
    raise CliError(f"{path}:{line}: {message}{more}", EXIT_INPUT)


def read_records(path: str) -> list[Record]:
    """Every record of a JSONL file, all checked; CliError (exit 4) names file:line."""
    try:
        with open(path, "rb") as handle:
            raw_lines = handle.read().split(b"\n")
    except OSError as error:
        raise CliError(f"cannot read --input {path!r}: {error.strerror or error}",
                       EXIT_INPUT) from None
    records, problems, seen_ids = [], [], {}
    for line, raw in enumerate(raw_lines, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            problems.append((line, "not UTF-8 text"))
            continue
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            problems.append((line, f"not valid JSON ({error.msg})"))
            continue
        data, problem = _check_record(value)
        if problem:
            problems.append((line, problem))
            continue
        key = ("line", line)
        if "id" in data:
            key = ("id", json.dumps(data["id"], ensure_ascii=False))
            if key in seen_ids:
                problems.append((line, f"duplicate id {key[1]} (first on line {seen_ids[key]})"))
                continue
            seen_ids[key] = line
        prompt = data["prompt"] if "prompt" in data else data["messages"]
        records.append(Record(line=line, index=len(records), key=key, data=data, prompt=prompt))
    _raise_first(path, problems)
    if not records:
        raise CliError(f"--input {path!r} holds no prompts", EXIT_INPUT)
    return records


def encode_records(tokenizer, records: list[Record], path: str, use_template: bool,
                   vocab_size: int, no_template_flag: bool) -> list[list[int]]:
    """Token ids per record (chat template when use_template); every record checked."""
    from jaxgen.api.text import encode_prompts

    rows, problems = [], []
    for record in records:
        if isinstance(record.prompt, list) and not use_template:
            why = "--no-chat-template is set" if no_template_flag else "the model has none"
            problems.append((record.line, f"'messages' needs the chat template and {why}; "
                                          f"give a 'prompt' instead"))
            continue
        try:
            [row] = encode_prompts(tokenizer, [record.prompt], chat=use_template)
        except Exception as error:  # a template's raise_exception, a tokenizer error
            problems.append((record.line, f"cannot build the prompt: {error}"))
            continue
        if not row:
            problems.append((record.line, "the prompt encodes to no tokens"))
            continue
        outside = [t for t in row if not 0 <= t < vocab_size]
        if outside:
            problems.append((record.line, f"the prompt holds token id {outside[0]}, outside "
                                          f"the model's vocabulary (0..{vocab_size - 1})"))
            continue
        rows.append(row)
    _raise_first(path, problems)
    return rows


# ----------------------------------------------------------------------------- the output file
def result_key(result: dict) -> tuple | None:
    if "id" in result:
        return ("id", json.dumps(result["id"], ensure_ascii=False))
    line = result.get("input_line")
    if isinstance(line, int) and not isinstance(line, bool):
        return ("line", line)
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


class OutputFile:
    """The --output JSONL file: checked before anything runs, appended a batch at a time."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None
        self.regular = True
        self.existing = 0  # bytes of complete lines already there
        self.partial = False  # a partial last line to drop (resume)
        self.needs_newline = False  # a complete last line without its "\n" (resume)
        self.created = False  # this run created the file
        self.wrote = False

    def _fail(self, what: str, error: OSError):
        return CliError(f"cannot {what} --output {self.path!r}: {error.strerror or error}",
                        EXIT_INPUT)

    def check(self, input_path: str, resume: bool, overwrite: bool) -> bytes:
        """Refuses bad targets; returns the bytes of complete lines to resume from."""
        path = self.path
        if _same_file(path, input_path):
            raise CliError(f"--output {path!r} is the --input file: jaxgen never writes over "
                           f"its input; choose another --output", EXIT_USAGE)
        if os.path.isdir(path):
            raise CliError(f"--output {path!r} is a directory; give a file path", EXIT_INPUT)
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise CliError(f"cannot write --output {path!r}: no such directory {parent!r}",
                           EXIT_INPUT)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return b""
        except OSError as error:
            raise self._fail("read", error) from None
        self.regular = stat.S_ISREG(info.st_mode)
        if not self.regular:
            if resume:
                raise CliError(f"--resume needs --output to be a regular file; {path!r} is "
                               f"not", EXIT_USAGE)
            return b""
        if overwrite:
            return b""
        try:  # read, not st_size: some files (/proc) report 0 bytes and hold data
            with open(path, "rb") as handle:
                data = handle.read() if resume else handle.read(1)
        except OSError as error:
            raise self._fail("read", error) from None
        if not data:
            return b""
        if not resume:
            raise CliError(f"--output {path!r} already holds data: pass --resume to continue "
                           f"that run, or --overwrite to replace it", EXIT_USAGE)
        end = data.rfind(b"\n") + 1
        tail = data[end:]
        if tail.strip():
            try:
                complete = result_key(json.loads(tail.decode("utf-8"))) is not None
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                complete = False
            if complete:  # a whole record without its newline (edited by hand): keep it
                self.needs_newline, end = True, len(data)
            else:
                self.partial = True
        self.existing = end
        return data[:end]

    def done_keys(self, data: bytes, input_path: str, keys: set) -> set:
        """Keys of the results in `data`; each must be a result of a record of the input."""
        done = set()
        for number, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            try:
                result = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                result = None
            key = result_key(result) if isinstance(result, dict) else None
            if key is None or "completion" not in result:
                raise CliError(f"{self.path}:{number}: not a jaxgen result (a JSON object with "
                               f"\"completion\" and \"id\" or \"input_line\"); --resume needs "
                               f"the output of an earlier run", EXIT_INPUT)
            if key not in keys:
                raise CliError(f"{self.path}:{number}: {describe_key(key)} is not in "
                               f"{input_path}: --output holds results of another input; choose "
                               f"another --output (or --overwrite)", EXIT_INPUT)
            done.add(key)
        return done

    def open(self) -> None:
        """Opens (creating) the file for appending; no data is changed yet."""
        existed = os.path.exists(self.path)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            raise self._fail("open", error) from None
        self.created = not existed
        if self.created:  # make the new directory entry durable too
            _fsync_path(os.path.dirname(os.path.abspath(self.path)))
        if self.regular and fcntl is not None:
            try:  # one run per output file: a second one would duplicate records
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self.fd)
                self.fd = None
                raise CliError(f"--output {self.path!r} is being written by another jaxgen run "
                               f"(it is locked); wait for it or choose another --output",
                               EXIT_INPUT) from None
            except OSError:  # a file system without locks: go on unlocked
                pass

    def prepare(self, overwrite: bool) -> str | None:
        """Right before the first batch: truncates (--overwrite) or drops a partial line."""
        note = None
        try:
            if self.regular and overwrite:
                os.ftruncate(self.fd, 0)
            elif self.partial:
                os.ftruncate(self.fd, self.existing)
                note = (f"dropped a partial last line of {self.path} (an interrupted write); "
                        f"its record runs again")
            if self.needs_newline:
                self._write(b"\n")
        except OSError as error:
            raise self._fail("write", error) from None
        return note

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def append(self, lines: list[str]) -> None:
        """Appends whole lines in one write, then fsync; on an error the file is restored."""
        data = "".join(lines).encode("utf-8")
        size = os.fstat(self.fd).st_size if self.regular else None
        try:
            self._write(data)
            _fsync(self.fd)
        except OSError as error:
            if size is not None:
                try:
                    os.ftruncate(self.fd, size)  # never leave a partial line behind
                except OSError:
                    pass
            raise self._fail("write", error) from None
        self.wrote = True

    def close(self) -> None:
        """Closes; a file this run created and never wrote to is removed again."""
        if self.fd is None:
            return
        empty = self.created and not self.wrote and self.regular
        try:
            empty = empty and os.fstat(self.fd).st_size == 0
        except OSError:
            empty = False
        os.close(self.fd)
        self.fd = None
        if empty:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as error:  # pipes, /dev/null, some special files: nothing to sync
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
            raise


def _fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        _fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _StdoutSink:
    """Results on stdout (no --output): whole batches, flushed."""

    regular = False

    @staticmethod
    def append(lines: list[str]) -> None:
        sys.stdout.write("".join(lines))
        sys.stdout.flush()

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- signals
class StopOnSignal:
    """While active, SIGINT / SIGTERM set `event` (generation stops within one chunk).

    A second SIGINT raises KeyboardInterrupt at once. Only the main thread can install
    handlers; elsewhere this does nothing (the caller's handlers stay).
    """

    def __init__(self):
        self.event = threading.Event()
        self.signum: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
        self.event.set()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


# ----------------------------------------------------------------------------- the run
def _batches(records: list[Record], done: set, batch_size: int):
    """The remaining records in the input's batch boundaries (resumed runs batch alike)."""
    for first in range(0, len(records), batch_size):
        chunk = [r for r in records[first:first + batch_size] if r.key not in done]
        if chunk:
            yield chunk


def _result(record: Record, tokenizer, new: list[int], reason: int) -> str:
    from jaxgen import stopping

    result = dict(record.data)
    result["input_line"] = record.line
    result["completion"] = tokenizer.decode(new, skip_special_tokens=True)
    result["new_tokens"] = len(new)
    result["stop_reason"] = stopping.STOP_REASONS.get(reason, str(reason))
    return json.dumps(result, ensure_ascii=False) + "\n"


def check_args(args) -> None:
    if args.resume and args.overwrite:
        raise CliError("--resume and --overwrite exclude each other", EXIT_USAGE)
    if (args.resume or args.overwrite) and not args.output:
        raise CliError(f"{'--resume' if args.resume else '--overwrite'} needs --output",
                       EXIT_USAGE)


def run_batch(args, load_model, make_config) -> int:
    """The batch run (see the module docstring).

    load_model(args) -> (model, params, tokenizer) and make_config(model, args) -> config come
    from jaxgen.cli.main (passed in, so that this module does not import it).
    """
    check_args(args)
    records = read_records(args.input)
    sink, done = _StdoutSink(), set()
    if args.output:
        sink = OutputFile(args.output)
        sink.check(args.input, args.resume, args.overwrite)  # refuse early, read-only
        sink.open()
    try:
        if args.output:  # again under the lock: what is there now is what we resume from
            existing = sink.check(args.input, args.resume, args.overwrite)
            done = sink.done_keys(existing, args.input, {r.key for r in records})
            if len(done) == len(records):
                print(f"jaxgen: nothing to do: all {len(records)} records of {args.input} are "
                      f"already in {args.output}", file=sys.stderr)
                return 0
        return _generate_all(args, records, done, sink, load_model, make_config)
    finally:
        sink.close()


def _generate_all(args, records, done, sink, load_model, make_config) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    import jaxgen
    from jaxgen import stopping
    from jaxgen.api.generate import outputs_to_lists

    model, params, tokenizer = load_model(args)
    cfg = make_config(model, args)
    remaining = [r for r in records if r.key not in done]
    use_template = not args.no_chat_template and tokenizer.chat_template is not None
    rows = encode_records(tokenizer, remaining, args.input, use_template, model.vocab_size,
                          args.no_chat_template)
    row_of = {r.key: row for r, row in zip(remaining, rows)}
    if isinstance(sink, OutputFile):
        note = sink.prepare(args.overwrite)
        if note and not args.quiet:
            print(f"jaxgen: note: {note}", file=sys.stderr)
    base_key = jax.random.key(args.seed)
    from jaxgen.cli.layouts import program_layout

    layout = program_layout(args)
    written, total_new, start = len(done), 0, time.perf_counter()
    with StopOnSignal() as stop, tqdm(total=len(records), initial=len(done), unit="prompt",
                                      file=sys.stderr, disable=args.quiet) as bar:
        for chunk in _batches(records, done, args.batch_size):
            if stop.event.is_set():
                break
            batch_rows = [row_of[r.key] for r in chunk]
            indices = jnp.asarray([r.index for r in chunk], jnp.uint32)
            keys = jax.vmap(lambda i: jax.random.fold_in(base_key, i))(indices)
            state = jaxgen.init_state(model, batch_rows, cfg, keys)
            out = jaxgen.generate(params, state, cfg, stop_event=stop.event, layout=layout)
            reasons = np.asarray(out.stop_reason).reshape(-1)
            if (reasons == stopping.CANCELLED).any():
                break  # the interrupted batch is not written
            bad = [i for i, reason in enumerate(reasons) if reason == stopping.INVALID_LOGITS]
            lines = []
            for i, (record, row, full) in enumerate(zip(chunk, batch_rows,
                                                        outputs_to_lists(out))):
                if i in bad:
                    continue
                new = full[len(row):]
                total_new += len(new)
                lines.append(_result(record, tokenizer, new, int(reasons[i])))
            if lines:
                sink.append(lines)
            written += len(lines)
            bar.update(len(lines))
            if bad:
                first = chunk[bad[0]]
                others = f" (and {len(bad) - 1} more in this batch)" if len(bad) > 1 else ""
                raise CliError(f"{args.input}:{first.line}: the model produced NaN/inf logits "
                               f"for this prompt (stop reason 'invalid_logits'){others}; check "
                               f"the weights (or try --dtype float32); {written} finished "
                               f"records are kept", EXIT_RUNTIME)
    if stop.event.is_set() and written < len(records):
        where = (f"{written} of {len(records)} records are in {args.output}; run the same "
                 f"command with --resume to continue" if args.output else
                 f"after {written} of {len(records)} records")
        code = EXIT_TERMINATED if stop.signum == signal.SIGTERM else EXIT_INTERRUPTED
        word = "terminated" if code == EXIT_TERMINATED else "interrupted"
        raise CliError(f"{word}: {where}", code)
    if not args.quiet:
        elapsed = time.perf_counter() - start
        print(f"[{written - len(done)} prompts, {total_new} new tokens, "
              f"{total_new / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0
