"""The `jaxgen` command's exit codes and its one-line error.

Example:
    >>> error = CliError("no such file", EXIT_INPUT)
    >>> str(error), error.code
    ('no such file', 4)
"""
from __future__ import annotations

EXIT_RUNTIME, EXIT_USAGE, EXIT_MODEL, EXIT_INPUT = 1, 2, 3, 4
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


class CliError(Exception):
    """A one-line error with its exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


__all__ = ["EXIT_INPUT", "EXIT_INTERRUPTED", "EXIT_MODEL", "EXIT_RUNTIME", "EXIT_TERMINATED",
           "EXIT_USAGE", "CliError"]
