"""The batch CLI's input: a JSONL file of prompts, read as a stream, never held whole.

The file is read line by line, each line at most `max_record_bytes` long (a longer, or an
endless, line stops the read at once with its `file:line`, never a MemoryError). The first
pass (`scan_input`) checks every record (UTF-8, standard JSON: no key twice, no NaN /
Infinity; fields and types, the result's own fields (RESULT_FIELDS) reserved; Unicode text: a
lone surrogate such as "\\ud800" is refused; duplicate ids) and keeps per record only its line, an
8-byte digest of its key and an 8-byte digest of its content (`InputIndex`). Later passes
(`iter_records`) read the file again and check each record against its digest, so an input
edited during a run is an error, not a silent mix.

Example:
    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
    >>> with open(path, "w") as f:
    ...     _ = f.write('{"id": "a", "prompt": "hi"}\\n\\n"bare string"\\n')
    >>> index = scan_input(path)
    >>> len(index), index.lines.tolist()
    (2, [1, 3])
    >>> [(r.line, r.index, r.key, r.prompt) for r in iter_records(path, index)]
    [(1, 0, ('id', '"a"'), 'hi'), (3, 1, ('line', 3), 'bare string')]
    >>> with open(path, "w") as f:
    ...     _ = f.write('{"prompt": "ok"}\\n{"prompt": "\\\\ud800"}\\n')
    >>> scan_input(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    jaxgen.cli.errors.CliError: ...p.jsonl:2: 'prompt' holds a lone surrogate (\\ud800), which is not Unicode text...
"""
from __future__ import annotations

import array
import bisect
import dataclasses
import hashlib
import json
import os
import stat
from collections.abc import Iterator

import numpy as np

from jaxgen.cli.errors import EXIT_INPUT, CliError

# A record (one line, without its newline) is at most this many bytes unless
# --max-record-bytes says otherwise: far above any model's context in text (a 128k-token
# context is about 0.5 MB), small enough that a batch of them fits in memory.
DEFAULT_MAX_RECORD_BYTES = 16 * 2**20
MAX_PROBLEMS_NAMED = 5  # an error names the first bad record and the lines of a few more
DIGEST_BYTES = 8


# The fields every result line gets (jaxgen.cli.batch's `_result`): an input record holding
# one would lose its value, so it is refused.
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
    """How an error names a record by its key.

    >>> describe_key(("id", '"a"')), describe_key(("line", 4))
    ('id "a"', 'input line 4')
    """
    return f"id {key[1]}" if key[0] == "id" else f"input line {key[1]}"


def key_digest(key: tuple) -> int:
    """An 8-byte digest of a record key, as an unsigned integer (what the index keeps)."""
    text = ("I" + key[1]) if key[0] == "id" else f"L{int(key[1])}"
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=DIGEST_BYTES)
                          .digest(), "little")


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


def check_record(value) -> tuple[dict | None, str | None]:
    """(record object, None) or (None, what is wrong), for one parsed JSON line.

    >>> check_record("hi")
    ({'prompt': 'hi'}, None)
    >>> check_record({"prompt": 3})
    (None, "'prompt' must be a string, got a number")
    >>> check_record({"prompt": "hi", "completion": "mine"})[1]  # doctest: +ELLIPSIS
    "field 'completion' is reserved: the result line writes input_line, completion, ..."
    """
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
    reserved = [field for field in RESULT_FIELDS if field in value]
    if reserved:
        return None, (f"field {reserved[0]!r} is reserved: the result line writes "
                      f"{', '.join(RESULT_FIELDS)}; rename it in the input")
    return value, None


def _surrogate_in(value, where: str) -> tuple[str, str] | None:
    """(where, the escape) of the first string (or object key) holding a lone surrogate."""
    if isinstance(value, str):
        for char in value:
            if 0xD800 <= ord(char) <= 0xDFFF:
                return where, f"\\u{ord(char):04x}"
        return None
    if isinstance(value, list):
        for number, item in enumerate(value, 1):
            found = _surrogate_in(item, f"{where} item {number}")
            if found:
                return found
    if isinstance(value, dict):
        for name, item in value.items():
            found = (_surrogate_in(name, f"{where} a field name")
                     or _surrogate_in(item, f"{where} {name!r}".strip()))
            if found:
                return found
    return None


def _describe_surrogate(data: dict) -> str:
    where, escape = _surrogate_in(data, "") or ("the record", "?")
    where = where.strip()
    if where.startswith("'messages' item "):  # 'messages' item 2 'content' -> message 2
        where = "message " + where[len("'messages' item "):]
    return (f"{where} holds a lone surrogate ({escape}), which is not Unicode text; "
            f"write the character itself or a valid \\u escape pair")


def canonical_bytes(data: dict) -> bytes:
    """The record as canonical JSON (sorted keys, no spaces) in UTF-8: what its digest covers
    (a re-formatted line is the same record). UnicodeEncodeError on a lone surrogate."""
    return json.dumps(data, ensure_ascii=False, sort_keys=True,
                      separators=(",", ":")).encode("utf-8")


def record_digest(key: tuple, data: dict) -> bytes:
    """8 bytes naming a record: its key and its content (see canonical_bytes)."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    digest.update(repr(key).encode("utf-8") + b"\n")
    digest.update(canonical_bytes(data))
    return digest.digest()


# ------------------------------------------------------------------------------ reading
class InputFile:
    """The --input file, opened once (every pass reads the same file, even if renamed)."""

    def __init__(self, path: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES):
        self.path = path
        self.max_record_bytes = int(max_record_bytes)
        try:  # stat first: opening a pipe with no writer would wait for one
            regular = stat.S_ISREG(os.stat(path).st_mode)
            self.handle = open(path, "rb") if regular else None
            regular = regular and stat.S_ISREG(os.fstat(self.handle.fileno()).st_mode)
        except OSError as error:
            raise CliError(f"cannot read --input {path!r}: {error.strerror or error}",
                           EXIT_INPUT) from None
        if not regular:
            if self.handle is not None:
                self.handle.close()
            raise CliError(f"--input {path!r} is not a regular file (a pipe, a device or a "
                           f"folder): batch mode reads it more than once; save it to a file "
                           f"first", EXIT_INPUT)

    def close(self) -> None:
        self.handle.close()

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, bytes without the newline) from the start of the file; a line past
        max_record_bytes raises CliError at once, naming file:line (an endless line ends)."""
        self.handle.seek(0)
        limit = self.max_record_bytes
        number = 0
        while True:
            raw = self.handle.readline(limit + 2)  # the record, its newline and one byte more
            if not raw:
                return
            number += 1
            body = raw[:-1] if raw.endswith(b"\n") else raw
            if len(body) > limit:
                raise CliError(f"{self.path}:{number}: the record is longer than "
                               f"--max-record-bytes={limit} bytes; raise the limit (e.g. "
                               f"--max-record-bytes {4 * limit}) or split the record",
                               EXIT_INPUT)
            yield number, body


def raise_problems(path: str, problems: list[tuple[int, str]], count: int,
                   code: int = EXIT_INPUT) -> None:
    """One line: the first problem, the lines of a few more and how many there are."""
    if not count:
        return
    line, message = problems[0]
    more = ""
    if count > 1:
        others = ", ".join(str(n) for n, _ in problems[1:MAX_PROBLEMS_NAMED + 1])
        plural = count > 2
        more = (f" (and {count - 1} more bad record{'s' if plural else ''}: "
                f"line{'s' if plural else ''} {others}"
                f"{', ...' if count - 1 > MAX_PROBLEMS_NAMED else ''})")
    raise CliError(f"{path}:{line}: {message}{more}", code)


class Problems:
    """The bad records of a pass: the first few kept, all counted (bounded memory)."""

    def __init__(self):
        self.first: list[tuple[int, str]] = []
        self.count = 0

    def add(self, line: int, message: str) -> None:
        self.count += 1
        bisect.insort(self.first, (line, message))
        del self.first[MAX_PROBLEMS_NAMED + 1:]  # the earliest lines are the ones named

    def raise_if_any(self, path: str, code: int = EXIT_INPUT) -> None:
        raise_problems(path, self.first, self.count, code)


class _DuplicateKey(ValueError):
    """A JSON object naming one key twice (json.loads would keep the last silently)."""


@dataclasses.dataclass(frozen=True)
class _NonFinite:
    """Where json.loads met NaN, Infinity or a number past float's range (e.g. 1e999)."""

    text: str


def _unique_object(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object, or _DuplicateKey naming the repeated key."""
    value = {}
    for key, item in pairs:
        if key in value:
            raise _DuplicateKey(key)
        value[key] = item
    return value


def _finite_float(text: str):
    number = float(text)
    return number if np.isfinite(number) else _NonFinite(text)


def _non_finite_in(value, where: str) -> tuple[str, str] | None:
    """(where, the number as written) of the first non-finite number in a parsed record."""
    if isinstance(value, _NonFinite):
        return where, value.text
    if isinstance(value, dict):
        labelled = ((repr(name), item) for name, item in value.items())
    elif isinstance(value, list):
        labelled = ((f"item {number}", item) for number, item in enumerate(value, 1))
    else:
        return None
    for label, item in labelled:
        found = _non_finite_in(item, f"{where} {label}".strip())
        if found:
            return found
    return None


def load_record(text: str):
    """json.loads for one input line, strict where JSON is: a duplicate key raises
    ValueError naming it, and NaN / Infinity (or 1e999) raise ValueError naming the field,
    since the result line could not hold them as standard JSON.

    >>> load_record('{"prompt": "hi", "prompt": "ho"}')
    Traceback (most recent call last):
    ValueError: the key 'prompt' appears twice in one object; keep one
    >>> load_record('{"prompt": "hi", "w": [1, NaN]}')
    Traceback (most recent call last):
    ValueError: 'w' item 2 is NaN, which is not standard JSON; write a finite number (or a string)
    """
    try:
        value = json.loads(text, object_pairs_hook=_unique_object, parse_constant=_NonFinite,
                           parse_float=_finite_float)
    except _DuplicateKey as error:
        raise ValueError(f"the key {error.args[0]!r} appears twice in one object; "
                         f"keep one") from None
    found = _non_finite_in(value, "")
    if found:
        where, written = found
        raise ValueError(f"{where or 'the record'} is {written}, which is not standard JSON; "
                         f"write a finite number (or a string)")
    return value


def parse_line(raw: bytes) -> tuple[dict | None, str | None]:
    """(record object, None), (None, what is wrong) or (None, None) for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    if not text.strip():
        return None, None
    try:
        value = load_record(text)
    except json.JSONDecodeError as error:
        return None, f"not valid JSON ({error.msg})"
    except RecursionError:
        return None, "not valid JSON (nested too deeply)"
    except ValueError as error:
        return None, str(error)
    return check_record(value)


def _key_of(data: dict, line: int) -> tuple:
    if "id" in data:
        return ("id", json.dumps(data["id"], ensure_ascii=False))
    return ("line", line)


@dataclasses.dataclass
class InputIndex:
    """What the first pass keeps per record (16 bytes + a line number; no text, no tokens).

    lines:   [N] int64, the record's 1-based line
    keys:    [N] uint64, key_digest of each record's key
    digests: N * 8 bytes, record_digest of each record, in input order
    """

    path: str
    lines: np.ndarray
    keys: np.ndarray
    digests: bytes

    def __len__(self) -> int:
        return int(self.lines.shape[0])

    def digest(self, index: int) -> bytes:
        return self.digests[index * DIGEST_BYTES:(index + 1) * DIGEST_BYTES]

    def sorted_keys(self) -> np.ndarray:
        return np.sort(self.keys)

    def has_keys(self, digests: np.ndarray) -> np.ndarray:
        """[M] bool: which key digests are keys of this input's records."""
        ordered = self.sorted_keys()
        where = np.clip(np.searchsorted(ordered, digests), 0, max(len(ordered) - 1, 0))
        return ordered[where] == digests if len(ordered) else np.zeros(len(digests), bool)


def _duplicates(source: InputFile, keys: array.array, lines: array.array,
                problems: Problems) -> None:
    """Every id used twice: the later line, naming the id and its first line (the ids are
    read again from the file for the few that are named: the scan keeps no ids)."""
    keys_np = np.frombuffer(keys, np.uint64)
    lines_np = np.frombuffer(lines, np.int64)
    order = np.lexsort((lines_np, keys_np))  # by key, then by line
    same = np.flatnonzero(keys_np[order][1:] == keys_np[order][:-1])
    if not len(same):
        return
    first_of, found = {}, []
    for position in same:
        key = int(keys_np[order[position]])
        first_of.setdefault(key, int(lines_np[order[position]]))
        found.append((int(lines_np[order[position + 1]]), first_of[key]))
    named = {later for later, _ in sorted(found)[:MAX_PROBLEMS_NAMED + 1]}
    ids = {}
    for number, raw in source.lines():
        if number in named:
            data, _ = parse_line(raw)
            ids[number] = _key_of(data, number)[1]
    for later, first in sorted(found):
        ident = f" {ids[later]}" if later in ids else ""
        problems.add(later, f"duplicate id{ident} (first on line {first})")


def scan_input(path: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
               source: InputFile | None = None) -> InputIndex:
    """The first pass: every record checked, the index built; CliError (exit 4) names
    file:line of the first bad record (and counts the others)."""
    own = source is None
    source = source or InputFile(path, max_record_bytes)
    lines, keys, digests = array.array("q"), array.array("Q"), bytearray()
    problems = Problems()
    try:
        for number, raw in source.lines():
            data, problem = parse_line(raw)
            if problem:
                problems.add(number, problem)
                continue
            if data is None:
                continue
            key = _key_of(data, number)
            try:
                digest = record_digest(key, data)
            except UnicodeEncodeError:
                problems.add(number, _describe_surrogate(data))
                continue
            lines.append(number)
            keys.append(key_digest(key))
            digests += digest
        _duplicates(source, keys, lines, problems)
    finally:
        if own:
            source.close()
    problems.raise_if_any(path)
    if not lines:
        raise CliError(f"--input {path!r} holds no prompts", EXIT_INPUT)
    return InputIndex(path=path, lines=np.frombuffer(lines, np.int64).copy(),
                      keys=np.frombuffer(keys, np.uint64).copy(), digests=bytes(digests))


def iter_records(path: str, index: InputIndex, source: InputFile | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Record]:
    """The records again, in order, each checked against the first pass (CliError, exit 4,
    when the file changed since)."""
    own = source is None
    source = source or InputFile(path, max_record_bytes)
    position = 0
    try:
        for number, raw in source.lines():
            data, problem = parse_line(raw)
            if data is None and problem is None:
                continue
            if (problem is not None or position >= len(index)
                    or int(index.lines[position]) != number):
                _changed(path, number)
            key = _key_of(data, number)
            try:
                same = record_digest(key, data) == index.digest(position)
            except UnicodeEncodeError:
                same = False
            if not same:
                _changed(path, number)
            prompt = data["prompt"] if "prompt" in data else data["messages"]
            yield Record(line=number, index=position, key=key, data=data, prompt=prompt)
            position += 1
    finally:
        if own:
            source.close()
    if position != len(index):
        _changed(path, int(index.lines[position]))


def _changed(path: str, line: int):
    raise CliError(f"{path}:{line}: --input changed while jaxgen was reading it; nothing "
                   f"more is generated (the finished results are kept: run again with "
                   f"--resume once the file stays put)", EXIT_INPUT)


__all__ = ["DEFAULT_MAX_RECORD_BYTES", "RESULT_FIELDS", "InputFile", "InputIndex", "Problems",
           "Record", "check_record", "describe_key", "iter_records", "key_digest", "load_record",
           "raise_problems", "record_digest", "scan_input"]
