"""Reading self-distillation data (see distill_data.py) into training batches.

Every batch is a function of (seed, step) alone: epoch e visits the examples in the order of
`permutation(seed, e)`, so a resumed run reads exactly what an uninterrupted run would.

    sequence_batch   windows of whole sequences (draft models, MTP layers): tokens,
                     the teacher's final hidden state, and the answer positions as the mask
    position_batch   single positions (exit adapters): layer-E hidden -> final hidden

Example (in-memory data: one sequence of 6 tokens, a 2-token prompt):
    >>> import numpy as np
    >>> data = DistillSet(tokens=np.arange(6, dtype=np.int32), starts=np.array([0, 6]),
    ...                   prompt_lens=np.array([2]), final=np.ones((6, 4), np.float16))
    >>> batch = sequence_batch(data, step=0, batch=1, length=8)
    >>> batch["tokens"].tolist(), batch["mask"].astype(int).tolist()
    ([[0, 1, 2, 3, 4, 5, 0, 0]], [[0, 1, 1, 1, 1, 0, 0, 0]])
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np


@dataclasses.dataclass
class DistillSet:
    """The arrays of distill_data.py (memory-mapped when read from a folder)."""

    tokens: np.ndarray  # int32 [N]
    starts: np.ndarray  # int64 [S + 1]
    prompt_lens: np.ndarray  # int32 [S]
    final: np.ndarray  # fp16 [N, D]
    layers: dict = dataclasses.field(default_factory=dict)  # {E: fp16 [N, D]}

    @classmethod
    def load(cls, folder: str) -> "DistillSet":
        """Opens a distill_data.py folder (hidden states memory-mapped)."""
        path = lambda name: os.path.join(folder, name)  # noqa: E731
        with open(path("meta.json"), encoding="utf-8") as f:
            exits = json.load(f)["exits"]
        return cls(tokens=np.load(path("tokens.npy")), starts=np.load(path("starts.npy")),
                   prompt_lens=np.load(path("prompt_lens.npy")),
                   final=np.load(path("final.npy"), mmap_mode="r"),
                   layers={e: np.load(path(f"layer_{e}.npy"), mmap_mode="r") for e in exits})

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_lens)

    def answer_positions(self) -> np.ndarray:
        """Flat indices t whose next token is an answer token (t in [prompt - 1, len - 2])."""
        spans = [np.arange(s + p - 1, e - 1) for s, e, p in
                 zip(self.starts[:-1], self.starts[1:], self.prompt_lens)]
        return np.concatenate(spans).astype(np.int64)


def epoch_order(count: int, seed: int, epoch: int) -> np.ndarray:
    """The visiting order of `count` examples in `epoch` (a function of seed and epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(count)


def pick(count: int, batch: int, seed: int, step: int) -> np.ndarray:
    """Example indices of batch `step`: consecutive slices of each epoch's order."""
    flat = np.arange(step * batch, (step + 1) * batch)
    epochs, offsets = flat // count, flat % count
    return np.array([epoch_order(count, seed, e)[o] for e, o in zip(epochs, offsets)])


def sequence_batch(data: DistillSet, step: int, batch: int, length: int, seed: int = 0,
                   layers: tuple[int, ...] = ()) -> dict:
    """{"tokens" int32 [B, T], "hidden" fp16 [B, T, D], "mask" f32 [B, T]}: one window of
    `length` tokens per sequence (a random one, from (seed, step), when it is longer), right
    padded. mask[b, t] = 1 where position t predicts an answer token (the teacher's
    distribution is the head on hidden[b, t]). With `layers`, also "layer_{E}" fp16
    [B, T, D]: the hidden state after layers [0, E) in the same windows."""
    rows = pick(data.num_sequences, batch, seed, step)
    rng = np.random.default_rng([seed, 1 << 20, step])
    dim = data.final.shape[-1]
    tokens = np.zeros((batch, length), np.int32)  # [B, T]
    hidden = np.zeros((batch, length, dim), np.float16)  # [B, T, D]
    mask = np.zeros((batch, length), np.float32)  # [B, T]
    states = {e: np.zeros((batch, length, dim), np.float16) for e in layers}  # {E: [B, T, D]}
    for b, row in enumerate(rows):
        start, end = int(data.starts[row]), int(data.starts[row + 1])
        first_answer = start + int(data.prompt_lens[row]) - 1
        if end - start > length:
            start = int(rng.integers(start, end - length + 1))
        stop = min(end, start + length)
        width = stop - start
        tokens[b, :width] = data.tokens[start:stop]
        hidden[b, :width] = data.final[start:stop]
        for e, array in states.items():
            array[b, :width] = data.layers[e][start:stop]
        t = np.arange(start, stop)
        mask[b, :width] = (t >= first_answer) & (t < end - 1)
    return {"tokens": tokens, "hidden": hidden, "mask": mask,
            **{f"layer_{e}": array for e, array in states.items()}}


def position_batch(data: DistillSet, positions: np.ndarray, step: int, batch: int,
                   exit_layer: int, seed: int = 0) -> dict:
    """{"exit_hidden" fp16 [N, D], "hidden" fp16 [N, D]}: `batch` of the given flat
    `positions` (answer_positions()), layer E's state and the final state at each."""
    index = np.sort(positions[pick(len(positions), batch, seed, step)])
    return {"exit_hidden": np.asarray(data.layers[exit_layer][index]),
            "hidden": np.asarray(data.final[index])}
