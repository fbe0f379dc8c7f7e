"""The program form of a `GenerationConfig`: the config a compiled program is keyed on.

A config's static fields are part of the compiled program. Three of them only size or end a
call and are never read inside the compiled loop, so a new value need not compile again:

    max_new_tokens, max_length   the budgets travel in the state (DecodeState.max_new [B])
                                 and the token buffer is sized to a bucket (init_state)
    stop_strings                 the tables travel in the state (DecodeState.stop_tables,
                                 padded to bucketed sizes by jaxgen.stopping.strings)
    max_time                     the chunked driver reads it on the host

`program_config` sets them to their neutral values and turns `eos_token_id` into an
`EosTable`: the ids as an int32 [E] PyTree leaf (dynamic: new ids reuse the program), only the
count E static (beam search keeps HF's max(2, 1 + #EOS) * num_beams candidates: a shape).
With `bad_words_ids` the ids stay static (HF drops single-token bad words that are EOS ids,
a host-side rule).
`cfg.eos_ids` of a program config is that table: `len()`, `bool()` and iteration work as on
the tuple, and `eos_array(ids)` gives the int32 [E] array either way.

Example (two EOS ids, two budgets, one program key):
    >>> import jax
    >>> from jaxgen.config.generation import GenerationConfig
    >>> a = program_config(GenerationConfig(max_new_tokens=5, eos_token_id=[2, 7]))
    >>> b = program_config(GenerationConfig(max_new_tokens=9, eos_token_id=[3, 4]))
    >>> jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    True
    >>> len(a.eos_ids), eos_array(a.eos_ids).tolist(), eos_array((2,)).tolist()
    (2, [2, 7], [2])
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# The static fields a program never reads, with the value the program form holds instead.
SIZING_FIELDS = {"max_new_tokens": None, "max_length": 20, "stop_strings": None,
                 "max_time": None}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EosTable:
    """The EOS ids of a program config: ids int32 [E] (dynamic); E is the static count.

    Behaves like the tuple it replaces where the loops use one: `len()`, `bool()` (any ids)
    and iteration (scalar int32 arrays).
    """

    ids: jax.Array  # int32 [E]

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self):
        return iter([self.ids[i] for i in range(len(self))])


def eos_array(eos_ids) -> jax.Array:
    """int32 [E]: the EOS ids of a config (`cfg.eos_ids`: a tuple, or a program config's
    EosTable) as one array."""
    if isinstance(eos_ids, EosTable):
        return eos_ids.ids
    return jnp.asarray(tuple(int(t) for t in eos_ids), jnp.int32).reshape(-1)


def program_config(cfg):
    """`cfg` in program form (see the module docs): the sizing fields neutral, the EOS ids a
    dynamic table. The dynamic leaves are kept as they are (traced ones too)."""
    from jaxgen.config.generation import with_static

    eos = cfg.eos_token_id
    if isinstance(eos, EosTable) or not eos or cfg.bad_words_ids is not None:
        table = eos  # bad_words_ids drops single-token EOS entries on the host: static ids
    elif any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(cfg)):
        table = EosTable(ids=jnp.asarray(eos, jnp.int32))  # [E] a constant of the trace
    else:
        table = EosTable(ids=jax.device_put(np.asarray(eos, np.int32)))  # [E], no program
    return with_static(cfg, eos_token_id=table, **SIZING_FIELDS)


__all__ = ["EosTable", "SIZING_FIELDS", "eos_array", "program_config"]
