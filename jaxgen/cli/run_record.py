"""What a batch run was: the record `--resume` checks, kept next to --output.

`<output>.jaxgen-run` (JSON) holds the settings that change results (--max-new-tokens, the
sampling flags, --seed, the chat template switch, --dtype, --weights, --truncation), the
model (its name and a fingerprint of its config, tokenizer and file sizes) and an 8-byte
digest of every input record, in order (jaxgen.cli.batch_input.record_digest: the record's
key and content). A sidecar file keeps --output pure JSONL, the results as users parse them.

It is written atomically (a temporary file, fsync, rename, fsync of the folder) before the
first result is appended, so after a crash or SIGKILL an output with results always has its
record. `--resume` compares: an input with a record inserted, removed or edited, other
settings or another model is refused (exit 2) with what differs, instead of answering some
records twice and others never, or mixing two settings in one file. Settings that do not
change results (--batch-size, --layout, --quiet, the caches) may change between runs.

Example:
    >>> import argparse
    >>> args = argparse.Namespace(max_new_tokens=8, do_sample=False, temperature=None,
    ...     top_k=None, top_p=None, repetition_penalty=None, seed=0, no_chat_template=False,
    ...     dtype="float32", weights="float", truncation="none", model="tiny")
    >>> then = RunRecord.start(args, digests=b"12345678" * 2)
    >>> now = RunRecord.start(argparse.Namespace(**{**vars(args), "max_new_tokens": 3}),
    ...                       digests=b"12345678" + b"abcdefgh")
    >>> differences(then, now, lines=[1, 5])
    ['--max-new-tokens: 8 in that run, 3 now', 'the input differs from line 5 on (record 2 of 2 is not the one that run read: records edited, inserted or removed)']
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile

from jaxgen.cli.batch_input import DIGEST_BYTES
from jaxgen.cli.batch_output import fsync, fsync_path
from jaxgen.cli.errors import EXIT_INPUT, EXIT_USAGE, CliError

SUFFIX = ".jaxgen-run"
FORMAT = "jaxgen batch run 1"

# The flags whose values change what a record's result is (flag -> argparse attribute).
RESULT_FLAGS = {
    "--max-new-tokens": "max_new_tokens",
    "--do-sample": "do_sample",
    "--temperature": "temperature",
    "--top-k": "top_k",
    "--top-p": "top_p",
    "--repetition-penalty": "repetition_penalty",
    "--seed": "seed",
    "--no-chat-template": "no_chat_template",
    "--dtype": "dtype",
    "--weights": "weights",
    "--truncation": "truncation",
}


def record_path(output: str) -> str:
    """Where the run record of `output` is kept.

    >>> record_path("out/results.jsonl")
    'out/results.jsonl.jaxgen-run'
    """
    return output + SUFFIX


def model_name(args) -> str:
    """The model as the run names it: a path made absolute, a known name in lower case."""
    from jaxgen.models.registry import DEFAULT_MODEL

    name = args.model or DEFAULT_MODEL
    return os.path.realpath(name) if os.path.exists(name) else str(name).lower()


def model_fingerprint(model, tokenizer, name: str) -> str:
    """A digest of what makes the model answer as it does, cheap to compute: its class and
    config, its tokenizer (vocabulary, merges, template, special tokens) and, for a model on
    disk, the names and sizes of its files (the weights are not read again)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(type(model).__name__.encode() + b"\n")
    digest.update(repr(getattr(model, "config", None)).encode("utf-8", "replace") + b"\n")
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend", None)
        if backend is not None and hasattr(backend, "to_str"):
            digest.update(backend.to_str().encode("utf-8", "replace"))
        digest.update(repr((getattr(tokenizer, "chat_template", None),
                            sorted(getattr(tokenizer, "special_tokens", {}).items())))
                      .encode("utf-8", "replace"))
    if os.path.isdir(name):
        entries = sorted(entry for entry in os.listdir(name)
                         if os.path.isfile(os.path.join(name, entry)))
        for entry in entries:
            digest.update(f"{entry}:{os.path.getsize(os.path.join(name, entry))}\n".encode())
    elif os.path.isfile(name):
        digest.update(f"{os.path.getsize(name)}\n".encode())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One batch run: its result settings, model and input records (digests, in order)."""

    settings: dict
    model: str
    digests: bytes
    fingerprint: str | None = None  # model_fingerprint, once the model is loaded

    @classmethod
    def start(cls, args, digests: bytes) -> RunRecord:
        settings = {flag: getattr(args, name, None) for flag, name in RESULT_FLAGS.items()}
        return cls(settings=settings, model=model_name(args), digests=bytes(digests))

    def with_fingerprint(self, fingerprint: str) -> RunRecord:
        return dataclasses.replace(self, fingerprint=fingerprint)

    @property
    def records(self) -> int:
        return len(self.digests) // DIGEST_BYTES

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "settings": self.settings, "model": self.model,
                           "model_fingerprint": self.fingerprint, "records": self.records,
                           "record_digests": self.digests.hex()}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        """ValueError when `text` is not a run record of this format."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT!r} record")
        digests = bytes.fromhex(data["record_digests"])
        if len(digests) != int(data["records"]) * DIGEST_BYTES:
            raise ValueError("its record digests do not match its record count")
        if not isinstance(data["settings"], dict) or not isinstance(data["model"], str):
            raise ValueError("its settings or model are damaged")
        return cls(settings=data["settings"], model=data["model"], digests=digests,
                   fingerprint=data.get("model_fingerprint"))


def write_record(output: str, record: RunRecord) -> None:
    """Writes the run record of `output` atomically and durably: a reader (or a crash) sees
    the old file or the whole new one."""
    path = record_path(output)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".jaxgen-run-")
    except OSError as error:
        raise _cannot_write(output, path, error) from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(record.to_json())
            file.flush()
            fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        try:
            os.remove(temporary)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise _cannot_write(output, path, error) from None
        raise
    fsync_path(folder)


def _cannot_write(output: str, path: str, error: OSError) -> CliError:
    return CliError(f"cannot write --output {output!r}: its run record {path!r} cannot be "
                    f"written: {error.strerror or error}", EXIT_INPUT)


def read_record(path: str) -> RunRecord | None:
    """The run record at `path`, None when there is none; CliError (exit 2) when damaged."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"cannot read the run record {path!r}: {error}", EXIT_USAGE) from None
    try:
        return RunRecord.from_json(text)
    except (ValueError, KeyError, TypeError) as error:
        raise CliError(f"the run record {path!r} is damaged ({error}); --resume cannot check "
                       f"that it continues the same run: start again with --overwrite",
                       EXIT_USAGE) from None


def _shown(value) -> str:
    if value is None:
        return "not given"
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value) if isinstance(value, str) else str(value)


def differences(then: RunRecord, now: RunRecord, lines) -> list[str]:
    """What differs between the run that wrote the output and this one (settings, model,
    input records); `lines[i]` is the input line of record i now."""
    found = []
    for flag in RESULT_FLAGS:
        old, new = then.settings.get(flag), now.settings.get(flag)
        if old != new:
            found.append(f"{flag}: {_shown(old)} in that run, {_shown(new)} now")
    if then.model != now.model:
        found.append(f"--model: {then.model!r} in that run, {now.model!r} now")
    if then.fingerprint and now.fingerprint and then.fingerprint != now.fingerprint:
        found.append(f"the model {now.model!r} changed since that run (its config, tokenizer "
                     f"or files)")
    if then.digests != now.digests:
        size = DIGEST_BYTES
        first = next((i for i in range(min(then.records, now.records))
                      if then.digests[i * size:(i + 1) * size]
                      != now.digests[i * size:(i + 1) * size]),
                     min(then.records, now.records))
        if first == then.records < now.records:
            found.append(f"the input has {now.records} records, that run read "
                         f"{then.records} (records added from line {int(lines[first])} on)")
        elif first < now.records:
            found.append(f"the input differs from line {int(lines[first])} on (record "
                         f"{first + 1} of {now.records} is not the one that run read: records "
                         f"edited, inserted or removed)")
        else:
            found.append(f"the input ends after record {now.records}; that run read "
                         f"{then.records} records (records removed)")
    return found


def refuse_differences(output: str, then: RunRecord, now: RunRecord, lines) -> None:
    """CliError (exit 2) naming every difference; nothing when the runs agree."""
    found = differences(then, now, lines)
    if found:
        raise CliError(f"--resume: {output} was written by another run: {'; '.join(found)}. "
                       f"Resume with that run's input and settings, or start again with "
                       f"--overwrite", EXIT_USAGE)


__all__ = [
    "RESULT_FLAGS",
    "SUFFIX",
    "RunRecord",
    "differences",
    "model_fingerprint",
    "model_name",
    "read_record",
    "record_path",
    "refuse_differences",
    "write_record",
]
