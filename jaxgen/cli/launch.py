"""The `jaxgen` command's entry point: quiet from its first instant.

Loading jax and the model code takes a couple of seconds before `jaxgen.cli.main` can install
its signal guard. Until then, Ctrl-C or SIGTERM ends the process at once with one line and
exit 130 / 143 (nothing has been written yet), never a traceback. `main` then runs the command,
whose guard takes over the signals.

Example:
    >>> import signal
    >>> exit_code(signal.SIGINT), exit_code(signal.SIGTERM)
    (130, 143)
"""
from __future__ import annotations

import os
import signal


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal's number."""
    return 128 + int(signum)


def _quit_during_start(signum, frame) -> None:
    try:
        os.write(2, b"jaxgen: error: interrupted\n")
    except OSError:
        pass
    os._exit(exit_code(signum))


def main(argv=None) -> int:
    """Installs the start-up handlers, then runs `jaxgen.cli.main.main`."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _quit_during_start)
    from jaxgen.cli.main import main as run_command

    return run_command(argv)
