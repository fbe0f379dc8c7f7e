"""Which layouts a `jaxgen` run uses: the weights' (--layout: stacked or one buffer per
layer) and the compiled programs' (`layout=` of every generate call; $JAXGEN_LAYER_LAYOUT
sets its default here, and only here).

Example:
    >>> import argparse
    >>> args = argparse.Namespace(layout="auto", input=None, chat=False, max_new_tokens=32)
    >>> choose_layout(args), program_layout(args)
    ('stacked', 'portable')
"""
from __future__ import annotations

import os

from jaxgen.cli.errors import EXIT_USAGE, CliError

# --layout auto: one answer of up to this many new tokens runs the stacked layout. Measured
# (benchmarks/bench_cli.py): stacked compiles ~2x faster and a warm start costs ~1.6 CPU-s
# less; unstacked decodes ~1.7x faster (about 36 ms less CPU per token), so unstacked wins
# from ~45 new tokens on a warm cache and ~200 on a cold one
STACKED_MAX_NEW_TOKENS = 256


def choose_layout(args) -> str:
    """"stacked" or "unstacked" for this run (--layout, else by request size)."""
    if args.layout != "auto":
        return args.layout
    if args.input or args.chat:  # many answers from one load: decode speed wins
        return "unstacked"
    return "stacked" if args.max_new_tokens <= STACKED_MAX_NEW_TOKENS else "unstacked"


def params_for_layout(model, params, args):
    """The weights as the run's layout holds them: per layer when it is unstacked (compiles
    small programs: callers check their inputs first)."""
    if choose_layout(args) != "unstacked":
        return params
    from jaxgen import models

    return models.unstack_layers(model, params)


LAYOUT_VARIABLE = "JAXGEN_LAYER_LAYOUT"  # the programs' layout when --layout does not settle it


def program_layout(args) -> str:
    """The `layout` every generate call of this run passes (jaxgen.runtime.backend.LAYOUTS):
    "portable" for the stacked weights layout (no split per call: the shortest compile), else
    $JAXGEN_LAYER_LAYOUT or "auto"."""
    from jaxgen.runtime.backend import LAYOUTS

    if choose_layout(args) == "stacked":
        return "portable"
    setting = os.environ.get(LAYOUT_VARIABLE, "auto").strip().lower() or "auto"
    if setting not in LAYOUTS:
        raise CliError(f"{LAYOUT_VARIABLE}={setting!r} is not a layout; expected one of "
                       f"{', '.join(LAYOUTS)}", EXIT_USAGE)
    return setting


__all__ = ["LAYOUT_VARIABLE", "STACKED_MAX_NEW_TOKENS", "choose_layout", "params_for_layout",
           "program_layout"]
