"""The executable-cache tests' process (tests/test_executable_cache.py): generates with
jaxgen.runtime.executable_cache enabled and prints one JSON line.

    python tests/executable_cache_script.py FOLDER [LAYOUT]   # LAYOUT: generate's layout=
    python tests/executable_cache_script.py --key    # program_key of sampling_call()

A fresh process, so the cache's module state is the one jaxgen.runtime.compiled uses (pytest's
doctest collection imports a second copy of every module). Each round enables a new store
on FOLDER after `jax.clear_caches()`, as a new `jaxgen` process starts: nothing compiled in
memory. A round generates a streamed greedy answer (the chunked driver: `start`, `advance`)
and a plain greedy call (`run_donated`) on a tiny model and records their tokens, how many
generate programs were traced (jaxgen.trace_count), how many XLA compiles ran (JAX's
backend-compile events) and the store's counts. Rounds: "first" (an empty folder), "warm",
then "damaged" after each entry is damaged in its own way (a flipped byte, a cut, another
entry's contents), then "repaired".
"""
from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

import jaxgen
from jaxgen.drivers.streamers import BaseStreamer
from jaxgen.models import Llama, LlamaConfig, tiny_llama
from jaxgen.models.tiny import TINY_SHAPES
from jaxgen.runtime import compiled, executable_cache

COMPILES: list[str] = []


class Quiet(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


def flip_a_byte(path, _):
    with open(path, "r+b") as file:
        file.seek(os.path.getsize(path) // 2)
        byte = file.read(1)
        file.seek(os.path.getsize(path) // 2)
        file.write(bytes([byte[0] ^ 0x5A]))


def cut(path, _):
    os.truncate(path, os.path.getsize(path) // 3)


def another_entrys_contents(path, other):  # intact, signed, but for another key
    with open(other, "rb") as source, open(path, "wb") as file:
        file.write(source.read())


DAMAGES = (flip_a_byte, cut, another_entrys_contents)


def one_round(folder: str, model, params, layout: str) -> dict:
    executable_cache.disable()
    jax.clear_caches()
    compiled._LAID_OUT.clear()  # a new process keeps no laid-out weights either
    prompts = [[1, 5, 9, 2], [3, 4]]
    cfg = jaxgen.GenerationConfig(max_new_tokens=10)
    states = [jaxgen.init_state(model, prompts, cfg, jax.random.key(7)) for _ in range(2)]
    jax.block_until_ready(states)
    COMPILES.clear()
    executable_cache.enable(folder)
    traced = jaxgen.trace_count()
    streamed = jaxgen.generate(params, states[0], cfg, streamer=[Quiet(), Quiet()],
                               layout=layout)
    plain = jaxgen.generate(params, states[1], cfg, layout=layout)
    return {"tokens": [np.asarray(out.sequences).tolist() for out in (streamed, plain)],
            "traced": jaxgen.trace_count() - traced, "compiles": len(COMPILES),
            "stats": executable_cache.stats()}


def sampling_call():
    """(name, args, statics) of a sampling call: its config's static part holds a set of
    names; statics are the entry's static arguments (the loop, the layout)."""
    from jaxgen.api.plan import canonical_config
    from jaxgen.core.extensions import Extensions
    from jaxgen.loops.decode import DecodeLoop

    model = Llama(LlamaConfig(**{**TINY_SHAPES, "num_layers": 1}))
    shapes = jax.eval_shape(model.init_params, jax.random.key(0))  # nothing computed
    params = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), shapes)
    cfg = jaxgen.GenerationConfig(max_new_tokens=10, do_sample=True, temperature=0.7,
                                  top_k=5, top_p=0.9, min_p=0.1)
    state = jaxgen.init_state(model, [[1, 2, 3]], cfg, jax.random.key(0))
    return ("start", (params, state, canonical_config(cfg), None),
            {"loop": DecodeLoop(Extensions()), "layout": "auto"})


def main(folder: str, layout: str = "auto") -> None:
    # the key holds a hash of jaxgen's sources: pinned, so that an edit of the working tree
    # between two runs of a test does not make the second one miss (environment() is tested
    # on its own)
    executable_cache._SOURCE_HASH[:] = ["sources as the test's first run saw them"]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: COMPILES.append(event)
        if event.endswith("backend_compile_duration") else None)
    model, params = tiny_llama(seed=4, num_layers=1)
    rounds = {"first": one_round(folder, model, params, layout),
              "warm": one_round(folder, model, params, layout)}
    entries = sorted(os.path.join(folder, name) for name in os.listdir(folder)
                     if name.endswith(executable_cache.SUFFIX))  # not the key file
    for index, path in enumerate(entries):
        DAMAGES[index % len(DAMAGES)](path, entries[index - 1])
    rounds["damaged"] = one_round(folder, model, params, layout)
    rounds["repaired"] = one_round(folder, model, params, layout)
    rounds["entries"] = len(entries)
    print(json.dumps(rounds))


if __name__ == "__main__":
    if sys.argv[1] == "--key":
        print(executable_cache.program_key(*sampling_call(), b"environment"))
    else:
        main(*sys.argv[1:3])
