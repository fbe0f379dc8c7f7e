"""`DecodeState`: the immutable PyTree a decoding loop carries, and `init_state`.

    tokens      int32 [B, T]   prompt + generated, right-padded with pad_token_id
    length      int32 [B]      next write index per row
    prompt_len  int32 [B]
    max_new     int32 [B]      per-row budget of new tokens (dynamic)
    done        bool  [B]      rows still decoding are False (every row starts live)
    stop_reason int32 [B]      see jaxgen.stopping
    cache       Cache          static shapes (jaxgen.cache); donated to the jit
    key         PRNG key [B]   one key per row; the step key is fold_in(row_key, position)
    stop_tables                the stop-string tables (cfg.stop_strings), or None
    spec                       the assisted loop's carry in a final state, or None
    budget_source              the config field that set max_new, e.g. ("max_new_tokens", 5)

The model and the prompt bucket are static (aux data), so `jaxgen.generate(params, state,
cfg)` needs nothing else.

Example:
    >>> import jax
    >>> from jaxgen.config.generation import GenerationConfig
    >>> from jaxgen.models import tiny_llama
    >>> model, _ = tiny_llama()
    >>> state = init_state(model, [[1, 2, 3], [4, 5]], GenerationConfig(max_new_tokens=4),
    ...                    jax.random.key(0))
    >>> state.tokens.shape      # prompt bucket 16 + the bucket of 4 new tokens (64)
    (2, 80)
    >>> state.visible_len       # generate's outputs: prompt bucket + 4
    20
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache import Cache
from jaxgen.cache.sharding import (
    DATA,
    batch_sharding,
    cache_shardings,
    check_divides,
    check_mesh,
    replicated,
)
from jaxgen.config.fields import check_int
from jaxgen.config.generation import GenerationConfig
from jaxgen.constraints.automaton import ConstraintCarry, TokenAutomaton, start_carry
from jaxgen.core.budgets import budget_source
from jaxgen.core.cached_prefix import check_prefix, fit_cache
from jaxgen.core.context import TRUNCATIONS, check_context, model_positions, truncate_left
from jaxgen.stopping.strings import StopStringTables

MIN_PROMPT_BUCKET = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    tokens: jax.Array  # int32 [B, T]
    length: jax.Array  # int32 [B]
    prompt_len: jax.Array  # int32 [B]
    max_new: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]
    stop_reason: jax.Array  # int32 [B]
    cache: Cache
    key: jax.Array  # typed PRNG keys [B]
    model: Any = dataclasses.field(metadata=dict(static=True))  # jaxgen.core.contracts.Model
    prompt_bucket: int = dataclasses.field(metadata=dict(static=True))
    pad_token_id: int = dataclasses.field(metadata=dict(static=True))
    stop_tables: Optional[StopStringTables] = None  # when cfg.stop_strings is set
    spec: Any = None  # assisted mode, final state: the loop's carry (speculative.loop.SpecCarry)
    constraint: Optional[ConstraintCarry] = None  # token automaton + each row's state [B]
    # The buffer length the caller asked for (prompt bucket + largest budget) when the buffer
    # is padded to a bucket of new tokens (see `new_token_bucket`); None: the buffer itself.
    # generate trims its outputs to it and runs the program with None (one program a bucket).
    visible_len: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))
    # A program's state (`program_state`): the pad id as a dynamic int32 [] (pad_token_id is
    # then PAD_IN_ARRAY), so a new pad id (HF: the first EOS id of a model without one) reuses
    # the program. Read `state.pad` inside a loop.
    pad_array: Optional[jax.Array] = None
    # A continued state (jaxgen.core.cached_prefix): each row's first `cached` tokens already
    # have their K/V in `cache`, so the prefill runs only positions cached .. prompt_len - 1,
    # as one right-padded block of `prefill_width` positions (static). None: the whole prompt
    # bucket (cached = 0), today's prefill.
    cached: Optional[jax.Array] = None  # int32 [B]
    prefill_width: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))
    # The config field that set `max_new` at init_state and its value, e.g. ("max_new_tokens",
    # 5) (jaxgen.core.budgets): generate refuses a config with another budget. None: a state
    # built by hand, or a program's state (one program serves every budget).
    budget_source: Optional[tuple] = dataclasses.field(default=None,
                                                       metadata=dict(static=True))

    @property
    def pad(self):
        """The pad id for traced code: the static int, or a program state's int32 []."""
        return self.pad_token_id if self.pad_array is None else self.pad_array

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def buffer_len(self) -> int:
        return self.tokens.shape[1]

    def replace(self, **changes) -> "DecodeState":
        return dataclasses.replace(self, **changes)


PAD_IN_ARRAY = -1  # a program state's static pad_token_id: the id is `pad_array`


def program_state(state: DecodeState, tables=None) -> DecodeState:
    """`state` as a compiled program takes it: no visible_len, the pad id a dynamic int32 []
    (`DecodeState.pad`), and `tables` as its stop-string tables (the caller strips their
    strings: jaxgen.stopping.strings.program_tables)."""
    pad = state.pad_token_id
    if state.pad_array is None:
        traced = isinstance(state.tokens, jax.core.Tracer)
        pad_array = jnp.int32(pad) if traced else jax.device_put(np.int32(pad))  # []
        state = state.replace(pad_array=pad_array, pad_token_id=PAD_IN_ARRAY)
    return state.replace(visible_len=None, budget_source=None, stop_tables=tables)


def check_state_shapes(state: DecodeState) -> None:
    """ValueError unless the state's arrays have the ranks init_state gives them (tokens
    [B, T], per-row arrays [B]). A state whose rows were mapped away by `jax.vmap` (in_axes=0
    over one state) fails here with what to map instead, rather than deep inside a loop."""
    tokens = state.tokens
    rows = {"length": state.length, "prompt_len": state.prompt_len, "max_new": state.max_new,
            "done": state.done, "stop_reason": state.stop_reason, "key": state.key}
    shapes = [tuple(tokens.shape)] + [tuple(a.shape) for a in rows.values()]
    if len(shapes[0]) == 2 and all(s == shapes[0][:1] for s in shapes[1:]):
        return
    mapped = len(shapes[0]) == 1 and isinstance(tokens, jax.core.Tracer)
    raise ValueError(
        f"the state's arrays do not have init_state's shapes (tokens [B, T] and per-row "
        f"arrays [B]): tokens {shapes[0]}, "
        + ", ".join(f"{name} {s}" for name, s in zip(rows, shapes[1:]))
        + (". Under jax.vmap, a state's rows are already a batch: do not map over one "
           "state's rows (in_axes=0 on the state). To run several states in one program, map "
           "over a stack of states built alike (jax.tree.map(lambda *a: jnp.stack(a), s1, "
           "s2, ...), in_axes=(None, 0, None)); to sweep config values, map the config with "
           "GenerationConfig.vmap_axes(...)" if mapped else ""))


def caller_state(final: DecodeState | None, given: DecodeState) -> DecodeState | None:
    """A program's final state as the caller's: the static pad id, the stop strings, the
    visible_len and the budget source of the state they passed (`given`); the arrays are the
    program's."""
    if final is None or final.pad_array is None:
        return final
    tables = final.stop_tables
    if tables is not None and given.stop_tables is not None:
        tables = dataclasses.replace(tables, strings=given.stop_tables.strings)
    return final.replace(pad_token_id=given.pad_token_id, pad_array=None,
                         visible_len=given.visible_len, budget_source=given.budget_source,
                         stop_tables=tables)


def prompt_bucket(length: int) -> int:
    """The padded prompt length: at least 16, else the next of four steps per octave
    (16, 20, 24, 28, 32, 40, ..., 256, 320, 384, 448, 512, 640, ...). Prompts of one bucket
    share a compiled program; the prefill computes at most 25% padding (powers of two
    waste up to half of it).

    >>> [prompt_bucket(n) for n in (3, 17, 33, 280, 512, 513)]
    [16, 20, 40, 320, 512, 640]
    """
    if length <= MIN_PROMPT_BUCKET:
        return MIN_PROMPT_BUCKET
    step = next_pow2(length) // 8  # a quarter of the octave [2^(k-1), 2^k) that holds length
    return -(-length // step) * step


# New-token slots of the token buffer: budgets up to this share one bucket (see
# `new_token_bucket`).
MIN_NEW_TOKEN_BUCKET = 64


def new_token_bucket(budget: int) -> int:
    """The new-token slots of the buffer for the largest budget `budget`: 64 up to 64, then
    the prompt buckets' steps (80, 96, 112, 128, 160, ...; at most 25% more). Budgets of one
    bucket share a compiled program; generate trims its outputs to the real budget.

    >>> [new_token_bucket(n) for n in (1, 64, 65, 100, 300)]
    [64, 64, 80, 112, 320]
    """
    return max(MIN_NEW_TOKEN_BUCKET, prompt_bucket(budget))


def _prompt_rows(prompts, lengths) -> list[list[int]]:
    if lengths is not None:
        array = np.asarray(prompts)
        lengths = np.asarray(lengths).reshape(-1)
        if array.ndim != 2 or lengths.shape[0] != array.shape[0]:
            raise ValueError("prompts as an array must be [B, S] with lengths [B]")
        if (lengths < 0).any() or (lengths > array.shape[1]).any():
            raise ValueError(f"prompt lengths must lie in 0..{array.shape[1]}, got {lengths.tolist()}")
        return [array[b, :n].tolist() for b, n in enumerate(lengths)]
    if isinstance(prompts, (np.ndarray, jax.Array)):
        array = np.asarray(prompts)
        if array.ndim == 1:
            array = array[None]
        if array.ndim != 2:
            raise ValueError(f"prompts must be a list of id lists or a [B, S] array, got shape {array.shape}")
        return array.tolist()
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(isinstance(t, (int, np.integer)) for t in prompts):
        prompts = [prompts]
    return [list(row) for row in prompts]


def _validate_rows(rows: list[list[int]], vocab_size: int) -> None:
    for b, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"prompt {b} is empty: every prompt needs at least one token")
        for token in row:
            if not isinstance(token, (int, np.integer)) or isinstance(token, bool):
                raise ValueError(f"prompt {b} holds {token!r}; token ids must be ints")
            if token < 0 or token >= vocab_size:
                raise ValueError(f"prompt {b} holds token id {token}, outside the vocabulary "
                                 f"(allowed: 0..{vocab_size - 1})")


def typed_keys(key) -> jax.Array:
    """A typed PRNG key (or [B] keys) from what a caller may pass: None (seed 0), a typed key
    (`jax.random.key(seed)`), raw uint32 key data (`jax.random.PRNGKey(seed)`, shape [2]), or
    one of either per row. Anything else is a ValueError saying what is expected."""
    if key is None:
        return jax.random.key(0)
    if isinstance(key, (int, float, np.integer, np.floating)) or not hasattr(key, "dtype"):
        raise ValueError(f"key must be a JAX PRNG key such as jax.random.key(seed) (one, or "
                         f"one per row), got {key!r}; pass the seed as jax.random.key({key!r})"
                         if isinstance(key, (int, np.integer)) else
                         f"key must be a JAX PRNG key such as jax.random.key(seed), got "
                         f"{type(key).__name__}")
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.ndim not in (1, 2) or key.shape[-1] != 2:
            raise ValueError(f"key must be a JAX PRNG key (jax.random.key(seed)) or raw uint32 "
                             f"key data of shape [2] / [B, 2] (jax.random.PRNGKey), got "
                             f"{key.dtype} {tuple(key.shape)}")
        key = jax.random.wrap_key_data(key)
    return key


def row_keys(key, batch: int) -> jax.Array:
    """One typed PRNG key per row: fold_in(key, row) for a single key, or the given [B] keys
    (see `typed_keys` for what `key` may be)."""
    key = typed_keys(key)
    if key.ndim == 0:
        rows = np.arange(batch, dtype=np.uint32)  # [B], host uint32: no iota / convert program
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows)  # [B]
    if key.shape != (batch,):
        raise ValueError(f"key must be one PRNG key or one per row ({batch}), got shape {key.shape}")
    return jnp.array(key, copy=True)  # [B]; a copy, because the state is donated


def resolve_pad_id(cfg: GenerationConfig, model) -> int:
    """HF: pad_token_id, else the model's pad id, else the first EOS id, else 0."""
    if cfg.pad_token_id is not None:
        return int(cfg.pad_token_id)
    model_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if model_pad is not None:
        return int(model_pad)
    return int(cfg.eos_ids[0]) if cfg.eos_ids else 0


def init_cache_for(model, cfg: GenerationConfig, batch: int, buffer_len: int, bucket: int,
                   dtype=jnp.float32):
    """The cache `cfg.cache_implementation` / `cfg.cache_config` asks for (jaxgen.cache).

    Ring-buffer kinds get rollback_slack = the prompt bucket unless set: the right-padded
    prefill rolls back from the bucket to each prompt's length. The "dynamic" kind starts at
    the smallest power of two >= max(initial_length, bucket + chunk_size), capped at
    buffer_len; jaxgen.drivers.growing doubles it between chunks.
    """
    kind = cfg.cache_implementation or "static"
    if kind == "static" and not cfg.cache_config:
        return model.init_cache(batch, buffer_len, dtype)
    from jaxgen.cache import validate_cache_config
    opts = dict(cfg.cache_config or {})
    if kind in ("sliding_window", "quantized") and opts.get("rollback_slack") is None:
        opts["rollback_slack"] = bucket
    max_len = buffer_len
    if kind == "dynamic":
        full = validate_cache_config(kind, opts)
        max_len = min(buffer_len, next_pow2(max(full["initial_length"],
                                                 bucket + full["chunk_size"])))
    return model.init_cache(batch, max_len, dtype, kind=kind, cache_config=opts)


def _copy_keys(key, prompts: int, copies: int):
    """Per-row keys [B] given for the prompts -> [B * copies]: copy r of prompt b draws with
    fold_in(key[b], r). A single key is split per expanded row by row_keys as usual."""
    key = typed_keys(key)
    if key.ndim == 0:  # one key: row_keys splits it over the expanded rows
        return key
    if key.shape != (prompts,):
        raise ValueError(f"key must be one PRNG key or one per prompt ({prompts}), got shape "
                         f"{key.shape}")
    return jax.vmap(lambda k: jax.vmap(lambda r: jax.random.fold_in(k, r))(
        jnp.arange(copies)))(key).reshape(-1)  # [B * copies]


def available_memory_bytes() -> int | None:
    """Memory the default device can hold: the accelerator's limit, or the host's RAM."""
    device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # backends without memory statistics
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        import os
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_shortfall(model, cfg: GenerationConfig, batch: int, buffer_len: int, bucket: int,
                     dtype, cache=None) -> str | None:
    """What the token buffer and the KV cache of `batch` rows x `buffer_len` positions need
    beyond the device's memory, in words ("the KV cache and token buffer for ... need X GiB,
    more than the device's Y GiB"), or None when they fit (shapes only: no allocation).
    cache: optionally the cache's shapes already computed, each leaf with the `sharding` it
    will get (jax.ShapeDtypeStruct): then the bytes are those of one device's shard."""
    limit = available_memory_bytes()
    if limit is None:
        return None
    if cache is None:
        cache = jax.eval_shape(lambda: init_cache_for(model, cfg, batch, buffer_len, bucket,
                                                      dtype))
    needed = sum(_shard_nbytes(leaf) for leaf in jax.tree_util.tree_leaves(cache)) \
        + batch * buffer_len * 4
    if needed <= limit:
        return None
    return (f"the KV cache and token buffer for {batch} row(s) x {buffer_len} positions need "
            f"{needed / 2**30:.1f} GiB, more than the device's {limit / 2**30:.1f} GiB")


def check_fits_memory(model, cfg: GenerationConfig, batch: int, buffer_len: int, bucket: int,
                      dtype, cache=None) -> None:
    """Raises ValueError before anything is allocated when the token buffer and the KV cache
    of this call alone would exceed the device's memory (`memory_shortfall`)."""
    shortfall = memory_shortfall(model, cfg, batch, buffer_len, bucket, dtype, cache)
    if shortfall is not None:
        raise ValueError(f"{shortfall}: lower max_new_tokens / max_length / max_cache_len or "
                         f"the batch, or use cache_implementation='dynamic' / 'quantized'")


def _check_host_buffer_fits(batch: int, buffer_len: int) -> None:
    """ValueError when the host token buffer int32 [batch, buffer_len] alone exceeds memory."""
    limit = available_memory_bytes()
    needed = batch * buffer_len * 4
    if limit is not None and needed > limit:
        raise ValueError(f"the token buffer for {batch} row(s) x {buffer_len} positions needs "
                         f"{needed / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} GiB "
                         f"available: lower max_new_tokens / max_length / max_cache_len or "
                         f"the batch")


def _shard_nbytes(leaf) -> int:
    """Bytes of one device's shard of an abstract array (the whole array if unsharded)."""
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return int(np.prod(shape)) * jnp.dtype(leaf.dtype).itemsize


def check_cache_dtype(dtype) -> None:
    """The cache dtype must be floating point (the quantized cache is a cache kind)."""
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"cache_dtype={dtype!r} is not a floating dtype (allowed: float32, "
                         f"bfloat16, float16); for int8 / 4-bit K/V use "
                         f"cache_implementation='quantized'")


def _buffer_len_option(cfg: GenerationConfig, buffer_len) -> int | None:
    """The requested static buffer length: init_state's buffer_len or cfg.max_cache_len."""
    wanted = cfg.max_cache_len
    if buffer_len is not None:
        check_int("buffer_len", buffer_len, low=1)
        if wanted is not None and int(wanted) != int(buffer_len):
            raise ValueError(f"buffer_len={buffer_len} and cfg.max_cache_len={wanted} disagree; "
                             f"pass one of them")
        return int(buffer_len)
    return None if wanted is None else int(wanted)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1).

    >>> [next_pow2(n) for n in (0, 1, 5, 64, 65)]
    [1, 1, 8, 64, 128]
    """
    return 1 << max(int(n) - 1, 0).bit_length()


def _sharded_cache(model, cfg, batch, buffer_len, bucket, dtype, mesh):
    """The cache allocated directly in its shards on `mesh` (never whole on one device),
    after the memory check of one device's shard."""
    def make():
        return init_cache_for(model, cfg, batch, buffer_len, bucket, dtype)
    shapes = jax.eval_shape(make)
    shardings = cache_shardings(shapes, mesh)  # raises where the cache cannot be split
    abstract = jax.tree_util.tree_map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        shapes, shardings)
    check_fits_memory(model, cfg, batch, buffer_len, bucket, dtype, cache=abstract)
    if getattr(shapes, "memory_kind", None) is not None:  # offloaded: built, then moved
        return jax.device_put(make(), shardings)
    options = tuple(sorted((cfg.cache_config or {}).items()))
    try:
        hash(options)
    except TypeError:  # an unhashable cache_config value: allocate without reusing
        return jax.jit(make, out_shardings=shardings)()
    return _allocator(model, cfg.cache_implementation, options, batch, buffer_len, bucket,
                      jnp.dtype(dtype), shardings)()


@functools.lru_cache(maxsize=32)
def _allocator(model, kind, options, batch, buffer_len, bucket, dtype, shardings):
    """A jitted function that allocates one cache shape in its shards (reused by later
    init_state calls of the same shape and mesh, so they do not compile again)."""
    cfg = GenerationConfig(cache_implementation=kind, cache_config=dict(options) or None)
    return jax.jit(lambda: init_cache_for(model, cfg, batch, buffer_len, bucket, dtype),
                   out_shardings=shardings)


def check_batch_fits(batch: int, mesh) -> None:
    """ValueError naming both sizes unless the mesh's "data" axis divides the rows."""
    check_divides("the batch (rows)", batch, mesh, DATA,
                  "pass a number of prompts (times num_return_sequences) the data axis "
                  "divides, or a mesh with a smaller data axis")


def state_shardings(state: DecodeState, mesh) -> DecodeState:
    """The state's PyTree with a NamedSharding in place of every array: rows on the mesh's
    "data" axis (tokens [B, T], length, keys, ... [B]), the cache's rows on "data" and its KV
    heads on "model" (jaxgen.cache.sharding), stop-string tables whole on every device.
    Raises ValueError when the data axis does not divide the rows (or "model" the KV heads).
    """
    mesh = check_mesh(mesh)
    check_batch_fits(state.batch, mesh)
    rows = lambda array: batch_sharding(mesh, array.ndim)  # noqa: E731
    whole = replicated(mesh)
    return state.replace(
        tokens=rows(state.tokens), length=rows(state.length),
        prompt_len=rows(state.prompt_len), max_new=rows(state.max_new),
        done=rows(state.done), stop_reason=rows(state.stop_reason),
        cache=cache_shardings(state.cache, mesh), key=rows(state.key),
        stop_tables=jax.tree_util.tree_map(lambda _: whole, state.stop_tables),
        spec=jax.tree_util.tree_map(lambda _: whole, state.spec),
        constraint=None if state.constraint is None else state.constraint.replace(
            automaton=jax.tree_util.tree_map(lambda _: whole, state.constraint.automaton),
            state=rows(state.constraint.state)))


def placed_carry(automaton: TokenAutomaton, batch: int, mesh) -> ConstraintCarry:
    """`start_carry` on `mesh`: the automaton's tables whole on every device, each row's
    automaton state with its row (on "data"). Built from host copies, shard by shard, so it
    also holds across processes (every process passes the same automaton)."""
    mesh = check_mesh(mesh)

    def place(host: np.ndarray, sharding):
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    whole = replicated(mesh)
    tables = jax.tree_util.tree_map(lambda a: place(np.array(a), whole), automaton)
    states = np.full((batch,), int(np.asarray(automaton.initial)), np.int32)  # [B]
    return ConstraintCarry(automaton=tables, state=place(states, batch_sharding(mesh, 1)))


def shard_state(state: DecodeState, mesh) -> DecodeState:
    """The state placed on `mesh` (see `state_shardings`); `jaxgen.generate` then runs
    sharded. Raises ValueError where a part cannot be split (the batch, a cache kind)."""
    return jax.device_put(state, state_shardings(state, mesh))


def init_state(model, prompts, cfg: GenerationConfig | None = None, key=None, *,
               lengths=None, max_new_tokens=None, cache_dtype=jnp.float32,
               buffer_len: int | None = None, tokenizer=None, mesh=None,
               process_local: bool = False, constraint: TokenAutomaton | None = None,
               truncation: str | None = None, prefix=None) -> DecodeState:
    """Builds the initial decoding state for a batch of prompts.

    prompts: a list of token-id lists (ragged), or a padded [B, S] array with `lengths`.
    Sampling with cfg.num_return_sequences = R > 1 (num_beams = 1) expands every prompt to R
    adjacent rows, as HF does; per-prompt keys [B] then give copy r fold_in(key[b], r).
    max_new_tokens: optional per-row budgets [B] (each <= the config's budget).
    buffer_len: optional static buffer length T (default: cfg.max_cache_len, else prompt
    bucket + `new_token_bucket(largest budget)`: budgets of one bucket share a compiled
    program; `visible_len` = prompt bucket + largest budget is what generate's outputs are
    trimmed to. With a mesh: prompt bucket + largest budget).
    Every prompt plus its budget must fit the model's `max_position_embeddings` (models with
    dynamic NTK RoPE scaling extrapolate and are not limited; see
    jaxgen.core.context.model_positions) and a fixed buffer_len / max_cache_len:
    ContextTooLong (a ValueError) names the prompt, before anything is allocated.
    truncation: None (the default: too long is an error) or "left": a prompt that does not fit
    keeps its last tokens (as transformers' pipelines truncate), so that it fits with its
    max_new_tokens budget (budgets from max_length are not truncated).
    cache_dtype: a floating dtype (float32, bfloat16, float16); the int8 / 4-bit cache is
    `cache_implementation="quantized"`.
    tokenizer: needed when cfg.stop_strings is set (its vocabulary builds the stop tables).
    mesh: a jax.sharding.Mesh with axes "data" and "model": the rows go on "data" and the
    KV cache's heads on "model" (`state_shardings`; the cache is allocated in its shards).
    Pair it with params placed by `jaxgen.models.shard(model, params, mesh)`.
    process_local (multi-host, with a mesh): `prompts` are this process's rows only; every
    process passes the same number of rows and the state is their concatenation in process
    order (the prompt bucket and budgets agree across processes; a single key gives global
    row i the key fold_in(key, i), as on one host). Without it every process passes the
    same global prompts.
    constraint: a jaxgen.constraints.automaton.TokenAutomaton (e.g. from
    jaxgen.constraints.compile.compile_constraint): every row starts at its initial state and
    every mode masks and advances it (jaxgen.constraints.automaton).
    prefix: a jaxgen.CachedPrefix (jaxgen.prefill_prefix, jaxgen.continue_state): its tokens
    go before every prompt and its cache is copied into every row, so the prefill computes
    only each prompt's own tokens (`DecodeState.cached`); same tokens as without it. One
    cached row is shared by every row; otherwise one per prompt (no copies then).
    """
    cfg = cfg if cfg is not None else GenerationConfig()
    if not isinstance(cfg, GenerationConfig):
        raise TypeError(f"cfg must be a jaxgen.GenerationConfig, got {type(cfg).__name__}")
    check_cache_dtype(cache_dtype)
    rows = _prompt_rows(prompts, lengths)
    source = cached = None
    if prefix is not None:
        rows, source, cached = _after_prefix(prefix, model, rows, cfg, mesh, truncation)
    vocab_size = model.vocab_size
    _validate_rows(rows, vocab_size)
    cfg.validate_for_model(vocab_size)
    cfg.validate_for_batch(len(rows))
    if process_local and mesh is None:
        raise ValueError("process_local=True assembles each process's rows into one global "
                         "batch over a mesh: pass mesh= as well")
    copies = cfg.sample_copies  # sampling with num_return_sequences: each prompt R times
    if max_new_tokens is not None and copies > 1 and np.ndim(max_new_tokens) == 1:
        max_new_tokens = np.repeat(np.asarray(max_new_tokens), copies)
    if key is not None and copies > 1:
        key = _copy_keys(key, len(rows), copies)
    rows = [row for row in rows for _ in range(copies)]
    batch = len(rows)
    buffer_len = _buffer_len_option(cfg, buffer_len)
    check_truncation(truncation)
    budgets = _row_budgets(cfg, [len(r) for r in rows], max_new_tokens)
    rows = _fit_context(model, rows, budgets, copies, truncation, buffer_len,
                        by_max_length=cfg.max_new_tokens is None and max_new_tokens is None)
    stop_tables = None
    if cfg.stop_strings is not None:
        from jaxgen.stopping.strings import build_stop_tables
        stop_tables = build_stop_tables(tokenizer, cfg.stop_strings, vocab_size)
    prompt_lens = np.array([len(r) for r in rows], np.int32)  # [B]
    longest = int(prompt_lens.max())
    most = int(budgets.max())
    if process_local:  # every process must build the same program: agree on the shapes
        longest, most = _agree_across_processes(batch, longest, most)
    bucket = prompt_bucket(longest)
    width = None
    if prefix is not None:  # prefill only positions cached .. prompt_len - 1, a block of width
        cached = np.minimum(np.repeat(cached, copies), prompt_lens - 1).astype(np.int32)  # [B]
        width = prompt_bucket(int((prompt_lens - cached).max()))
        bucket = prompt_bucket(int(cached.max()) + width)
    visible_len = None
    if buffer_len is None and mesh is None:  # one program per bucket of budgets
        visible_len = bucket + most
        buffer_len = bucket + new_token_bucket(most)
    elif buffer_len is None:
        buffer_len = bucket + most
    elif bucket > buffer_len:
        raise ValueError(f"buffer_len / max_cache_len: prompt + max_new_tokens "
                         f"({int((prompt_lens + budgets).max())}, prompt bucket {bucket}) does "
                         f"not fit the buffer of {buffer_len} tokens")
    pad_id = resolve_pad_id(cfg, model)
    if mesh is None:  # shapes only, before the token buffer is allocated
        check_fits_memory(model, cfg, batch, buffer_len, bucket, cache_dtype)
    else:  # the cache's shards are checked once placed; the host buffer is whole here
        _check_host_buffer_fits(batch, buffer_len)
    tokens = np.full((batch, buffer_len), pad_id, np.int32)  # [B, T]
    for b, row in enumerate(rows):
        tokens[b, :len(row)] = row
    check_constraint(constraint, vocab_size)
    if mesh is not None:
        placed = _placed_state(model, cfg, mesh, process_local, key, cache_dtype, tokens,
                               prompt_lens, budgets, bucket, pad_id, stop_tables
                               ).replace(budget_source=budget_source(cfg))
        return placed if constraint is None else placed.replace(
            constraint=placed_carry(constraint, placed.batch, mesh))
    # host arrays go over with device_put: jnp.asarray / jnp.zeros would each compile (or
    # read back from the persistent cache) a small program, a CLI run's fixed cost
    cache = init_cache_for(model, cfg, batch, buffer_len, bucket, cache_dtype)
    if prefix is not None:
        cache = fit_cache(prefix.cache, cache, np.repeat(source, copies), cached)
    return DecodeState(
        tokens=jax.device_put(tokens),
        length=jax.device_put(prompt_lens),
        prompt_len=jax.device_put(prompt_lens.copy()),
        max_new=jax.device_put(budgets),
        done=jax.device_put(np.zeros((batch,), bool)),
        stop_reason=jax.device_put(np.zeros((batch,), np.int32)),
        cache=cache,
        key=row_keys(key, batch),
        model=model,
        prompt_bucket=bucket,
        pad_token_id=pad_id,
        stop_tables=stop_tables,
        constraint=None if constraint is None else start_carry(constraint, batch),
        visible_len=visible_len,
        cached=None if prefix is None else jax.device_put(cached),
        prefill_width=width,
        budget_source=budget_source(cfg),
    )


def _after_prefix(prefix, model, rows: list[list[int]], cfg: GenerationConfig, mesh,
                  truncation):
    """(rows with the prefix's tokens before each, the cached row each copies [P], how many
    positions each holds [P]) for init_state(prefix=)."""
    check_prefix(prefix, model)
    if mesh is not None or truncation is not None:
        raise ValueError("init_state(prefix=...) runs on one device without truncation: drop "
                         "mesh= / truncation=")
    if prefix.rows > 1 and cfg.sample_copies > 1:
        raise ValueError("a prefix of one cached row per prompt cannot be copied to "
                         "num_return_sequences rows: continue with num_return_sequences=1")
    source = prefix.source_rows(len(rows))  # [P]
    joined = [list(prefix.tokens[s]) + list(row) for s, row in zip(source, rows)]
    cached = np.array([prefix.cached[s] for s in source], np.int32)  # [P]
    return joined, source, cached


def _row_budgets(cfg: GenerationConfig, prompt_lens: list[int], max_new_tokens) -> np.ndarray:
    """int32 [B]: each row's budget of new tokens: cfg.max_new_tokens, else max_length minus
    the prompt, then init_state's per-row `max_new_tokens` (each within the former)."""
    batch = len(prompt_lens)
    lens = np.asarray(prompt_lens, np.int64)  # [B]
    if cfg.max_new_tokens is not None:
        budgets = np.full((batch,), int(cfg.max_new_tokens), np.int32)  # [B]
    else:
        budgets = (int(cfg.max_length) - lens).astype(np.int32)  # [B]
        if (budgets < 1).any():
            b = int(np.argmin(budgets))
            raise ValueError(f"prompt {b} has {lens[b]} tokens but max_length is "
                             f"{cfg.max_length}: the prompt is longer than the buffer; raise "
                             f"max_length or set max_new_tokens")
    if max_new_tokens is not None:
        check_int("max_new_tokens", max_new_tokens, per_row=True)
        values = np.asarray(max_new_tokens)
        if values.ndim > 1 or (values.ndim == 1 and values.shape[0] != batch):
            raise ValueError(f"per-row max_new_tokens must be one int or {batch} ints (one per "
                             f"row), got {max_new_tokens!r}")
        per_row = np.broadcast_to(values.astype(np.int64), (batch,))
        if (per_row < 1).any() or (per_row > budgets).any():
            raise ValueError(f"per-row max_new_tokens must lie in 1..{budgets.max()}, got "
                             f"{per_row.tolist()}")
        budgets = per_row.astype(np.int32)
    return budgets


def check_truncation(truncation) -> None:
    """ValueError unless `truncation` is None or "left" (jaxgen.core.context.TRUNCATIONS)."""
    if truncation not in TRUNCATIONS:
        raise ValueError(f"`truncation` must be one of {list(TRUNCATIONS)}, got "
                         f"{truncation!r}")


def _fit_context(model, rows: list[list[int]], budgets: np.ndarray, copies: int, truncation,
                 buffer_len: int | None, *, by_max_length: bool) -> list[list[int]]:
    """The rows checked against the model's positions and a fixed buffer (ContextTooLong
    naming the prompt), after truncation="left" kept each prompt's end where it is too long.
    Budgets from max_length (prompt + budget = max_length) are not truncated: a shorter
    prompt only gets a larger budget."""
    positions = model_positions(model)
    if truncation == "left" and not by_max_length:
        limits = [n for n in (positions, buffer_len) if n is not None]
        if limits:
            rows = [truncate_left(row, min(limits), int(budget))
                    for row, budget in zip(rows, budgets)]
    per_prompt = lambda values: np.asarray(values).reshape(-1, copies).max(axis=1)  # noqa: E731
    lengths = per_prompt([len(r) for r in rows])  # [P]
    check_context(positions, lengths, per_prompt(budgets), where=lambda p: f"prompt {p}")
    if buffer_len is not None:
        check_context(buffer_len, lengths, per_prompt(budgets), where=lambda p: f"prompt {p}",
                      limit_name="buffer (buffer_len / max_cache_len)")
    return rows


def check_constraint(constraint, vocab_size: int) -> None:
    """ValueError unless `constraint` is None or a TokenAutomaton over `vocab_size` tokens."""
    if constraint is None:
        return
    if not isinstance(constraint, TokenAutomaton):
        raise ValueError(f"`constraint` must be a jaxgen.constraints.automaton.TokenAutomaton "
                         f"(see jaxgen.constraints.compile.compile_constraint), got "
                         f"{type(constraint).__name__}")
    if constraint.vocab_size != vocab_size:
        raise ValueError(f"`constraint` was built for a vocabulary of {constraint.vocab_size} "
                         f"tokens but the model has {vocab_size}")


def _agree_across_processes(batch: int, longest: int, most: int) -> tuple[int, int]:
    """(longest prompt, largest budget) over every process; all must hold `batch` rows."""
    if jax.process_count() == 1:
        return longest, most
    from jax.experimental import multihost_utils
    every = np.asarray(multihost_utils.process_allgather(
        np.array([batch, longest, most], np.int32))).reshape(-1, 3)  # [P, 3]
    if (every[:, 0] != batch).any():
        raise ValueError(f"process_local=True needs the same number of rows on every process, "
                         f"got {every[:, 0].tolist()}")
    return int(every[:, 1].max()), int(every[:, 2].max())


def _placed_state(model, cfg, mesh, process_local, key, cache_dtype, tokens, prompt_lens,
                  budgets, bucket, pad_id, stop_tables) -> DecodeState:
    """The state built from host arrays straight into its shards on `mesh`: each process
    fills only the shards of its own devices (jax.make_array_from_callback for global rows,
    jax.make_array_from_process_local_data for process-local ones)."""
    mesh = check_mesh(mesh)
    local, buffer_len = tokens.shape
    batch = local * (jax.process_count() if process_local else 1)
    check_batch_fits(batch, mesh)
    first = _first_local_row(mesh, batch) if process_local else 0
    keys = typed_keys(key)
    if keys.ndim == 0:
        keys = row_keys(keys, batch)[first:first + local]  # [local]: global row i -> fold_in(key, i)
    else:
        keys = row_keys(keys, local)  # [local]: given per row
    impl = jax.random.key_impl(keys)

    def rows(host):
        host = np.asarray(host)
        sharding = batch_sharding(mesh, host.ndim)
        if process_local:
            return jax.make_array_from_process_local_data(sharding, host,
                                                          (batch,) + host.shape[1:])
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    whole = replicated(mesh)
    tables = jax.tree_util.tree_map(
        lambda leaf: jax.make_array_from_callback(np.shape(leaf), whole,
                                                  lambda index, a=np.asarray(leaf): a[index]),
        stop_tables)
    return DecodeState(
        tokens=rows(tokens), length=rows(prompt_lens), prompt_len=rows(prompt_lens),
        max_new=rows(budgets), done=rows(np.zeros((local,), bool)),
        stop_reason=rows(np.zeros((local,), np.int32)),
        cache=_sharded_cache(model, cfg, batch, buffer_len, bucket, cache_dtype, mesh),
        key=jax.random.wrap_key_data(rows(jax.random.key_data(keys)), impl=impl),
        model=model, prompt_bucket=bucket, pad_token_id=pad_id, stop_tables=tables)


def _first_local_row(mesh, batch: int) -> int:
    """The first global row this process's devices hold (rows on "data")."""
    index = batch_sharding(mesh, 1).addressable_devices_indices_map((batch,))
    starts = sorted({(where[0].start or 0) for where in index.values()})
    return starts[0]
