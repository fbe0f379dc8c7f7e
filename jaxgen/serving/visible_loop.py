"""The engine's decode chunk over the part of the slots' cache its rows can reach.

Every slot's buffer is `max_len` positions, and attention reads all of a static cache, so a
chunk would cost what the longest possible request costs. `VisibleDecodeLoop(visible=T')`
runs the plain loop's steps on the cache cropped to its first T' positions and writes them
back (jaxgen.cache.time_prefix); the engine picks the smallest T' of a short ladder
(`visible_lengths`: two rungs an octave, then max_len) that holds every live row's length plus
the chunk's steps, so a few programs serve every moment of a run.

Example:
    >>> visible_lengths(704), visible_lengths(100)
    ((128, 192, 256, 384, 512, 704), (100,))
    >>> pick_visible(visible_lengths(704), 300)
    384
"""
from __future__ import annotations

import dataclasses

from jaxgen.cache.layer_forms import holds_layer_tuples, to_layer_tuples, to_stacked_layers
from jaxgen.cache.time_prefix import write_prefix
from jaxgen.loops.decode import DecodeLoop
from jaxgen.runtime.backend import layers_apart

SMALLEST_VISIBLE = 128  # the ladder's first rung (positions)


def visible_lengths(max_len: int, smallest: int = SMALLEST_VISIBLE) -> tuple[int, ...]:
    """The ladder of cropped lengths below max_len, then max_len: `smallest` times 1, 1.5, 2,
    3, 4, 6, ... (two rungs an octave: a chunk attends over at most a third more positions
    than its rows reach)."""
    rungs, size = [], smallest
    while size < max_len:
        rungs.append(size)
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return (*rungs, max_len)


def pick_visible(ladder: tuple[int, ...], needed: int) -> int:
    """The smallest rung holding `needed` positions (the last rung when none does)."""
    return next((rung for rung in ladder if rung >= needed), ladder[-1])


@dataclasses.dataclass(frozen=True)
class VisibleDecodeLoop(DecodeLoop):
    """DecodeLoop whose `advance` runs on the cache's first `visible` positions (static).

    The slots' cache comes in the form the engine holds it, and the backend does not convert
    it (splitting the whole buffer per layer and stacking it back would copy all of it every
    chunk): one buffer per layer when the params run layer by layer, else stacked (the
    cropped part is then split here when the params run layer by layer). Only the cropped
    positions are written back, in the form the cache came in."""

    visible: int = 0
    takes_layer_tuples = False

    def advance(self, params, state, record, begin, end, cfg, inputs=None):
        full = state.cache  # [.., T, ..], stacked or per layer
        cropped = full.resize(self.visible)  # [.., visible, ..]
        if layers_apart(params):
            cropped = to_layer_tuples(cropped)
        state, record = super().advance(params, state.replace(cache=cropped), record, begin,
                                        end, cfg, inputs)
        ran = state.cache if holds_layer_tuples(full) else to_stacked_layers(state.cache)
        return state.replace(cache=write_prefix(full, ran)), record


__all__ = ["SMALLEST_VISIBLE", "VisibleDecodeLoop", "pick_visible", "visible_lengths"]
