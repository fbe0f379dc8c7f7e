"""Running the C++ compiler so that it never outlives its welcome: a process group of its
own, a deadline, and nothing left behind when the build or the process stops.

`run_compiler(command, deadline, what)` waits for the command until `deadline`
(time.monotonic()), then kills its whole group (the driver and the cc1plus / as / ld it
started) and raises RuntimeError. The group is also killed when waiting ends in an
exception, when the process exits (atexit), and, while the main thread waits, on SIGTERM
(then the process terminates as SIGTERM's default would). On Linux the driver also gets
SIGKILL when the thread that started it dies (prctl PR_SET_PDEATHSIG), so a process killed
while a background build runs leaves no compiler waiting (a cc1plus it had started finishes
its file and exits).

Example:
    >>> import time
    >>> run_compiler(["echo", "built"], time.monotonic() + 30, "the build").stdout
    'built\\n'
    >>> run_compiler(["sleep", "30"], time.monotonic() + 0.2, "the build")
    Traceback (most recent call last):
    ...
    RuntimeError: sleep did not finish within the build's deadline
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

_RUNNING: set[int] = set()  # process groups of compilers running now
_RUNNING_LOCK = threading.Lock()


def kill_running() -> None:
    """Kills every compiler group this process is running."""
    with _RUNNING_LOCK:
        groups = list(_RUNNING)
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass


atexit.register(kill_running)

# On Linux the compiler runs under this stub: it asks the kernel for SIGKILL when its parent
# thread dies (prctl PR_SET_PDEATHSIG; the setting survives exec), checks that its parent is
# still the one that started it, then becomes the compiler (same pid, same process group).
# A stub rather than subprocess's preexec_fn: that would fork a multithreaded JAX process.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None).prctl(1, 9, 0, 0, 0) != 0 or os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(125)\n"
    "try:\n"
    "    os.execv(sys.argv[2], sys.argv[2:])\n"
    "except OSError as error:\n"
    "    print(error, file=sys.stderr)\n"
    "    sys.exit(127)\n")


def _launched(command: list[str]) -> list[str]:
    """The command to start: the compiler found on $PATH, under the stub on Linux.
    FileNotFoundError when there is no such program."""
    program = shutil.which(command[0])
    if program is None:
        raise FileNotFoundError(f"no program {command[0]!r} found (set CXX to a C++ compiler)")
    if not sys.platform.startswith("linux"):
        return [program, *command[1:]]
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), program,
            *command[1:]]


class _TermWhileWaiting:
    """While the main thread waits on a compiler: SIGTERM kills the compiler groups, then
    terminates the process as SIGTERM's default would (set only where no handler is)."""

    def __enter__(self):
        self.installed = (threading.current_thread() is threading.main_thread()
                          and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        if self.installed:
            signal.signal(signal.SIGTERM, self._on_term)
        return self

    @staticmethod
    def _on_term(signum, frame):
        kill_running()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def __exit__(self, *exc):
        if self.installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return False


def terms_while_waiting() -> _TermWhileWaiting:
    """A context for a wait in the main thread: SIGTERM stops the compilers and the process."""
    return _TermWhileWaiting()


def run_compiler(command: list[str], deadline: float, what: str) -> subprocess.CompletedProcess:
    """`command` run in a process group of its own, its output captured as text; RuntimeError
    (the group killed) when `deadline` passes first; `what` names the deadline's owner."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise RuntimeError(f"{what}'s deadline passed before {command[0]} started")
    process = subprocess.Popen(_launched(command), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    with _RUNNING_LOCK:
        _RUNNING.add(process.pid)
    try:
        with terms_while_waiting():
            out, err = process.communicate(timeout=remaining)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{command[0]} did not finish within {what}'s deadline") from None
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(process.pid)
        if process.returncode is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except OSError:
                pass
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, out, err)


__all__ = ["kill_running", "run_compiler", "terms_while_waiting"]
