"""`jaxgen` with a stall: an endless compiled loop at a chosen point (tests/test_cli_limits.py).

    python tests/cli_signal_script.py STALL MARKER -- jaxgen arguments...

STALL: "load" (inside the model load), "generate:K" (inside the K-th generate call, 1-based),
"written:K" (batch mode: inside the engine's first decode chunk once K results are in the
output, on the engine's thread) or "none". MARKER: a file created right before the stall
starts, so that the test signals the process while it sits in compiled code, where Python
signal handlers do not run.
"""
from __future__ import annotations

import os
import sys


def stall(marker: str) -> None:
    """Never returns: a jitted while_loop whose condition stays true, run to completion."""
    import jax
    import jax.numpy as jnp

    with open(marker, "w"):
        pass
    spin = jax.jit(lambda x: jax.lax.while_loop(lambda c: c >= 0, lambda c: (c + 1) % 7, x))
    spin(jnp.int32(0)).block_until_ready()


def main() -> int:
    where, marker, separator, *argv = sys.argv[1:]
    assert separator == "--", sys.argv
    import jaxgen
    from jaxgen.cli.main import main as jaxgen_main

    if where == "load":
        from jaxgen import models

        real_load = models.load

        def load(*args, **kwargs):
            stall(marker)
            return real_load(*args, **kwargs)

        models.load = load
    elif where.startswith("generate:"):
        stall_at = int(where.split(":")[1])
        real_generate = jaxgen.generate
        calls = []

        def generate(*args, **kwargs):
            calls.append(1)
            if len(calls) == stall_at:
                stall(marker)
            return real_generate(*args, **kwargs)

        jaxgen.generate = generate
    elif where.startswith("written:"):
        from jaxgen.cli import batch_output
        from jaxgen.serving import Engine

        stall_after, written = int(where.split(":")[1]), []
        real_append, real_advance = batch_output.OutputFile.append, Engine._advance

        def append(self, lines):
            real_append(self, lines)
            written.extend(lines)

        def advance(self):
            if len(written) >= stall_after:
                stall(marker)
            return real_advance(self)

        batch_output.OutputFile.append = append
        Engine._advance = advance
    elif where != "none":
        raise SystemExit(f"unknown stall {where!r}")
    return jaxgen_main(argv)


if __name__ == "__main__":  # the repository's jaxgen, as `python -m jaxgen.cli.main` from it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
