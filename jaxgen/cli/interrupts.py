"""Ctrl-C and SIGTERM for the `jaxgen` command: a stop within seconds, never a traceback.

Python runs a signal handler only between bytecodes of the main thread, so a handler alone
waits out a long compiled call, a long prefill or a model load. `SignalGuard` adds a
watchdog thread woken by the signal itself (`signal.set_wakeup_fd`): after `grace_s`
seconds (half a second after a second Ctrl-C) it takes the write lock, so that an append in flight
finishes (appends are whole batches, fsync'ed), prints one line and ends the process with
exit 130 (SIGINT) or 143 (SIGTERM).

Inside the guard, a signal raises `Interrupted` in the main thread (a BaseException: no
`except Exception` swallows it), except in a `soft()` block, where it only sets `event` (the
batch run passes it to the chunked driver as `stop_event` and stops within one chunk), and
inside `writing()`, where it waits for the append to end.

Example:
    >>> guard = SignalGuard(grace_s=5.0)
    >>> with guard:
    ...     with guard.soft():
    ...         os.kill(os.getpid(), signal.SIGTERM)
    ...         _ = guard.event.wait(5)
    >>> guard.event.is_set(), guard.code
    (True, 143)
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143
SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 2.0  # how long the main thread may take to stop by itself before the watchdog ends it
WRITE_WAIT_S = 30.0
SECOND_SIGNAL_WAIT_S = 0.5  # a second Ctrl-C: how long the main thread may take to stop  # how long the watchdog waits for an append (a write and an fsync) to end


def exit_code(signum: int) -> int:
    """130 for SIGINT (Ctrl-C), 143 for SIGTERM (128 + the signal's number, as shells say)."""
    return EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED


class Interrupted(BaseException):
    """Raised in the main thread by a signal; `code` is the exit code."""

    def __init__(self, signum: int):
        super().__init__("terminated" if signum == signal.SIGTERM else "interrupted")
        self.signum = signum
        self.code = exit_code(signum)


class SignalGuard:
    """While active (a `with` block in the main thread): SIGINT / SIGTERM stop the command
    within about `grace_s` seconds (see the module docstring). `describe()` gives the line
    printed when the watchdog ends the process (what is kept, how to resume)."""

    def __init__(self, grace_s: float = GRACE_S, stream=None):
        self.grace_s = float(grace_s)
        self.stream = stream
        self.event = threading.Event()
        self.signum: int | None = None
        self.describe: Callable[[], str] | None = None
        self._soft = 0
        self._writing = 0
        self._pending = False
        self._write_lock = threading.Lock()
        self._finished = threading.Event()
        self._previous: dict = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._watchdog: threading.Thread | None = None
        self.active = False

    @property
    def code(self) -> int | None:
        return None if self.signum is None else exit_code(self.signum)

    # ------------------------------------------------------------------ the main thread
    def _handle(self, signum, frame):
        first = self.signum is None
        if first:
            self.signum = signum
        self.event.set()
        if self._writing:
            self._pending = True
            return
        if self._soft and (first or signum != signal.SIGINT):
            return
        raise Interrupted(self.signum)

    @contextlib.contextmanager
    def soft(self):
        """Inside: a first signal only sets `event` (a second Ctrl-C still raises)."""
        self._soft += 1
        try:
            yield self
        finally:
            self._soft -= 1

    @contextlib.contextmanager
    def writing(self):
        """Around an append: no signal interrupts it, the watchdog waits for it."""
        with self._write_lock:
            self._writing += 1
            try:
                yield
            finally:
                self._writing -= 1
        if self._pending and not self._soft:
            self._pending = False
            raise Interrupted(self.signum)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread can handle signals: the caller's stay
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        try:
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            os.close(read)
            os.close(write)
            self._pipe = None
            return self
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._watchdog = threading.Thread(target=self._watch, name="jaxgen-signal-watchdog",
                                          daemon=True)
        self._watchdog.start()
        self.active = True
        return self

    def __exit__(self, *exc_info):
        if not self.active:
            return False
        with self._write_lock:  # from here on the watchdog neither prints nor ends anything
            self._finished.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_wakeup)
        read, write = self._pipe
        try:
            os.write(write, b"\0")  # wakes the watchdog, which sees _finished and returns
        except OSError:
            pass
        self._watchdog.join(timeout=5)
        os.close(read)
        os.close(write)
        self._pipe, self.active = None, False
        return False

    # ------------------------------------------------------------------ the watchdog
    def _watch(self):
        read = self._pipe[0]
        received: list[int] = []
        while not self._finished.is_set():
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data or self._finished.is_set():
                return
            received.extend(b for b in data if b in SIGNALS)
            if received:
                break
        else:
            return
        signum = received[0]
        again = received.count(signal.SIGINT) > 1
        if again:  # the main thread raises at once when it runs Python: a moment for that
            self._finished.wait(SECOND_SIGNAL_WAIT_S)
        else:
            # wait out the grace period, or a second Ctrl-C, whichever comes first
            deadline = threading.Event()
            timer = threading.Timer(self.grace_s, deadline.set)
            timer.daemon = True
            timer.start()
            while not deadline.is_set() and not self._finished.is_set():
                if _readable(read, 0.05):
                    try:
                        more = os.read(read, 64)
                    except OSError:
                        more = b""
                    if signal.SIGINT in more and signum == signal.SIGINT:
                        self._finished.wait(SECOND_SIGNAL_WAIT_S)
                        break
            timer.cancel()
        if self._finished.is_set():
            return
        self._end(signum)

    def _end(self, signum: int) -> None:
        """Ends the process once no append is in flight: one line, exit 130 / 143 (nothing
        when the main thread left the guard meanwhile: it reports the stop itself)."""
        locked = self._write_lock.acquire(timeout=WRITE_WAIT_S)
        if self._finished.is_set():
            if locked:
                self._write_lock.release()
            return
        word = "terminated" if signum == signal.SIGTERM else "interrupted"
        detail = ""
        if self.describe is not None:
            try:
                detail = self.describe()
            except Exception:  # the line must be printed whatever the state
                detail = ""
        stream = self.stream or sys.stderr
        try:
            stream.write(f"\njaxgen: error: {word}{': ' + detail if detail else ''}\n")
            stream.flush()
        except Exception:
            pass
        os._exit(exit_code(signum))


def _readable(fd: int, timeout: float) -> bool:
    import select

    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    except (OSError, ValueError):
        return False
    return bool(ready)


__all__ = ["EXIT_INTERRUPTED", "EXIT_TERMINATED", "GRACE_S", "Interrupted", "SignalGuard",
           "exit_code"]
