"""The batch CLI's output: the --output JSONL file (or stdout), appended a batch at a time.

Before anything runs the target is checked (never the input, not a folder, a folder that
exists, data there only with --resume or --overwrite); while a run writes it, it holds an
exclusive `flock` (one run per output). Each batch is one `write`, then `fsync`: a crash
leaves whole lines. `--resume` reads the file as a stream (never whole) and keeps only the
8-byte key digest of each finished result; a partial last line (an interrupted write, a full
disk) is dropped before the first new batch.

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> out = OutputFile(os.path.join(folder, "out.jsonl"))
    >>> out.check(os.path.join(folder, "in.jsonl"), resume=False, overwrite=False)
    False
    >>> out.open(); _ = out.prepare(overwrite=False)
    >>> out.append(['{"input_line": 1, "completion": "x"}\\n']); _ = out.close()
    >>> open(out.path).read()
    '{"input_line": 1, "completion": "x"}\\n'
"""
from __future__ import annotations

import array
import errno
import json
import os
import stat
import sys

import numpy as np

from jaxgen.cli.batch_input import describe_key, key_digest
from jaxgen.cli.errors import EXIT_INPUT, EXIT_USAGE, CliError

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

CHECK_AT_ONCE = 8192  # result keys checked against the input per numpy call


def result_key(result) -> tuple | None:
    """The key of a result object (its "id", else its "input_line"), None when it has none.

    >>> result_key({"id": "a", "input_line": 3}), result_key({"input_line": 3})
    (('id', '"a"'), ('line', 3))
    """
    if not isinstance(result, dict):
        return None
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


def _parse_result(raw: bytes):
    try:
        result = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return result if isinstance(result, dict) and "completion" in result else None


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
        self.companion: str | None = None  # a file of this run's, removed along with it
        self.results = 0  # complete results found by scan

    def _fail(self, what: str, error: OSError):
        return CliError(f"cannot {what} --output {self.path!r}: {error.strerror or error}",
                        EXIT_INPUT)

    def check(self, input_path: str, resume: bool, overwrite: bool) -> bool:
        """Refuses bad targets (read-only); True when the file holds data to resume from."""
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
            return False
        except OSError as error:
            raise self._fail("read", error) from None
        self.regular = stat.S_ISREG(info.st_mode)
        if not self.regular:
            if resume:
                raise CliError(f"--resume needs --output to be a regular file; {path!r} is "
                               f"not", EXIT_USAGE)
            return False
        if overwrite:
            return False
        try:  # read, not st_size: some files (/proc) report 0 bytes and hold data
            with open(path, "rb") as handle:
                data = handle.read(1)
        except OSError as error:
            raise self._fail("read", error) from None
        if data and not resume:
            raise CliError(f"--output {path!r} already holds data: pass --resume to continue "
                           f"that run, or --overwrite to replace it", EXIT_USAGE)
        return bool(data)

    def scan(self, index, input_path: str, max_line_bytes: int) -> np.ndarray:
        """The key digests ([M] uint64, sorted, unique) of the results already in the file,
        read as a stream; each must be a result of a record of `index`. Notes a partial
        last line (dropped by prepare) or a whole last line without its newline (kept)."""
        done, pending = array.array("Q"), []
        self.existing, self.partial, self.needs_newline, self.results = 0, False, False, 0
        offset = 0
        try:
            with open(self.path, "rb") as handle:
                number = 0
                while True:
                    raw = handle.readline(max_line_bytes + 2)
                    if not raw:
                        break
                    number += 1
                    whole = raw.endswith(b"\n")
                    if len(raw) > max_line_bytes and not whole:
                        self._not_a_result(number)
                    if not whole:  # the last line, without its newline
                        if raw.strip():
                            result = _parse_result(raw)
                            if result is not None and result_key(result) is not None:
                                self.needs_newline = True  # whole, edited by hand: kept
                                pending.append((number, result_key(result)))
                                offset += len(raw)
                            else:
                                self.partial = True
                        break
                    offset += len(raw)
                    if not raw.strip():
                        continue
                    key = result_key(_parse_result(raw))
                    if key is None:
                        self._not_a_result(number)
                    pending.append((number, key))
                    if len(pending) >= CHECK_AT_ONCE:
                        self._check_keys(pending, index, input_path, done)
        except OSError as error:
            raise self._fail("read", error) from None
        self._check_keys(pending, index, input_path, done)
        self.existing = offset
        return np.unique(np.frombuffer(done, np.uint64))

    def _not_a_result(self, number: int):
        raise CliError(f"{self.path}:{number}: not a jaxgen result (a JSON object with "
                       f"\"completion\" and \"id\" or \"input_line\"); --resume needs the output "
                       f"of an earlier run", EXIT_INPUT)

    def _check_keys(self, pending: list, index, input_path: str, done: array.array) -> None:
        if not pending:
            return
        digests = np.array([key_digest(key) for _, key in pending], np.uint64)
        known = index.has_keys(digests)
        if not known.all():
            number, key = pending[int(np.argmin(known))]
            raise CliError(f"{self.path}:{number}: {describe_key(key)} is not in "
                           f"{input_path}: --output holds results of another input; choose "
                           f"another --output (or --overwrite)", EXIT_INPUT)
        done.extend(int(d) for d in digests)
        self.results += len(pending)
        pending.clear()

    def open(self) -> None:
        """Opens (creating) the file for appending; no data is changed yet."""
        existed = os.path.exists(self.path)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            raise self._fail("open", error) from None
        self.created = not existed
        if self.created:  # make the new directory entry durable too
            fsync_path(os.path.dirname(os.path.abspath(self.path)))
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

    def holds_results(self) -> bool:
        """True when the (open) file holds complete results (resume, after scan)."""
        return self.results > 0

    def prepare(self, overwrite: bool) -> str | None:
        """Before the run record and the first batch: empties the file (--overwrite) or drops
        a partial last line, durably."""
        note = None
        try:
            if self.regular and overwrite:
                os.ftruncate(self.fd, 0)
                fsync(self.fd)
                self.existing = 0
            elif self.partial:
                os.ftruncate(self.fd, self.existing)
                fsync(self.fd)
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
            fsync(self.fd)
        except OSError as error:
            if size is not None:
                try:
                    os.ftruncate(self.fd, size)  # never leave a partial line behind
                except OSError:
                    pass
            raise self._fail("write", error) from None
        self.wrote = True

    def close(self) -> bool:
        """Closes; a file this run created and never wrote to is removed again (True), and
        its companion (the run record) with it."""
        if self.fd is None:
            return False
        empty = self.created and not self.wrote and self.regular
        try:
            empty = empty and os.fstat(self.fd).st_size == 0
        except OSError:
            empty = False
        os.close(self.fd)
        self.fd = None
        if empty:
            for path in (self.path, self.companion):
                try:
                    if path:
                        os.unlink(path)
                except OSError:
                    pass
        return empty


def fsync(fd: int) -> None:
    """os.fsync, quiet where there is nothing to sync (pipes, /dev/null, special files)."""
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
            raise


def fsync_path(path: str) -> None:
    """Best effort: fsync a folder (a new or renamed entry in it becomes durable)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class StdoutSink:
    """Results on stdout (no --output): whole batches, flushed."""

    regular = False

    @staticmethod
    def append(lines: list[str]) -> None:
        sys.stdout.write("".join(lines))
        sys.stdout.flush()

    def close(self) -> bool:
        return False


__all__ = ["OutputFile", "StdoutSink", "fsync", "fsync_path", "result_key"]
