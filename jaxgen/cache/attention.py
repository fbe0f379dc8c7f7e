"""The one attention kernel every cache kind reads through.

A cache hands the kernel one or more *key blocks*; their scores are concatenated along the
key axis, soft-maxed together (fp32) and each block contributes its share of the output.
A block is dense (float keys/values) or quantized (int8 codes with per-token, per-head
(per-group) scales). Blocks are heads-major, [B, Hkv, Tk, Dh]: each (row, head) holds its keys
as one contiguous [Tk, Dh] matrix. Quantized blocks are never dequantized: the query-key products are
scaled by the key scales, and the attention weights by the value scales:

    score[j] = (q . kq[j]) * k_scale[j] * scale          (per group, summed over groups)
    out      = sum_j (w[j] * v_scale[j]) * vq[j]

A quantized block may hold the codes of rotated keys / values, k R and v R (R orthogonal,
`rotation`; the int8 cache uses a Hadamard matrix to spread outlier channels): the kernel then
rotates the query instead, (q R) . (k R) = q . k, and rotates the block's output back by R^T.

The products are batched over (row, kv head) with the G query heads of a group and the S
query positions folded into the rows of one matmul, [G*S, Dh] x [Dh, Tk]: on CPU this is one
matmul per (row, head) instead of G*S matrix-vector products (5x faster at batch 8).

A long forward (a prefill of CAUSAL_MIN_QUERIES positions or more) over one dense block whose
key j sits at position j (`ordered`) runs QUERY_BLOCK queries at a time, each block over only
the key chunks between its sliding window's edge and its last query position, with an online
softmax: the causal half of the products is skipped and each block's scores stay in cache.

Soft-capping (Gemma 2's attn_logit_softcapping, `softcap`): the scaled scores pass through
softcap * tanh(score / softcap) before the mask and the softmax; without it the kernel is
unchanged.

Visibility of key j (at absolute position pos[j]) to a query at position p, with
age = p - pos[j]:

    pos[j] >= 0 and age >= 0                          (causal; -1 marks an empty slot)
    age < window                                      (sliding-window models, Mistral)
    min_age <= age < max_age  (or `bypass[j]`)        (int8 cache with a full-precision
                                                       residual window: recent keys come from
                                                       the residual block, older ones from the
                                                       int8 block)
    valid[j]                                          (block-specific, e.g. "older than the
                                                       chunk being written")

Token trees (jaxgen.speculative.tree): a forward of S queries at the contiguous slots
q_positions[b, 0] .. q_positions[b, 0] + S - 1 may pass `tree_mask` bool [B, S, S]. A key
at one of those slots (offset o from q_positions[b, 0], written by this forward) is then
visible to query s iff tree_mask[b, s, o] (its ancestors and itself), instead of o <= s; keys
before the block follow the rules above. Without it nothing changes.

Example (one query head group of 2 over 3 cached keys; every key is visible at position 2):
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache.attention import KeyBlock, attend_blocks
    >>> q = jnp.ones((1, 1, 2, 4))                       # [B, S, H, Dh]
    >>> k = jnp.ones((1, 1, 3, 4))                       # [B, Hkv, Tk, Dh]
    >>> v = jnp.arange(3.0)[None, None, :, None] * jnp.ones((1, 1, 3, 4))
    >>> block = KeyBlock(k=k, v=v, positions=jnp.arange(3))
    >>> out = attend_blocks(q, jnp.array([[2]]), [block], scale=0.5)
    >>> out.shape, float(out[0, 0, 0, 0])                # equal scores: the mean of 0, 1, 2
    ((1, 1, 2, 4), 1.0)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class KeyBlock:
    """One block of keys/values for `attend_blocks` (not a PyTree; built inside a trace).

    k, v: [B, Hkv, Tk, Dh] float, or int8 codes with k_scale / v_scale [B, Hkv, Tk, N]
    (N groups along Dh). positions: int32 [B, Tk] or [Tk] (-1 = empty).
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    valid: jax.Array | None = None  # bool [B, Tk]
    min_age: int = 0
    max_age: int | None = None
    bypass: jax.Array | None = None  # bool [B, Tk]: visible at any age >= 0 (min/max_age ignored)
    rotation: jax.Array | None = None  # [Dh, Dh] orthogonal R: k and v hold k R and v R
    unpack: Callable | None = None  # packed codes -> codes (4-bit pairs), run per key chunk
    ordered: bool = False  # positions[j] == j (a dense cache): causal key-chunk skipping applies

    @property
    def num_keys(self) -> int:
        return self.k.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]


def _visible(block: KeyBlock, q_positions: jax.Array, window: int | None,
             tree_mask: jax.Array | None = None) -> jax.Array:
    """bool [B, S, Tk]. tree_mask: bool [B, S, S] over this forward's own slots (module docs)."""
    positions = block.positions
    if positions.ndim == 1:
        positions = positions[None]  # [1, Tk]
    age = q_positions[:, :, None] - positions[:, None, :]  # [B, S, Tk]
    visible = (age >= 0) & (positions[:, None, :] >= 0)  # [B, S, Tk]
    if window is not None:
        visible &= age < window
    band = age >= block.min_age if block.min_age > 0 else None
    if block.max_age is not None:
        upper = age < block.max_age
        band = upper if band is None else band & upper
    if band is not None:
        if block.bypass is not None:
            band |= block.bypass[:, None, :]
        visible &= band
    if block.valid is not None:
        visible &= block.valid[:, None, :]
    if tree_mask is not None:
        visible = _tree_visible(visible, positions, q_positions, tree_mask)
    return visible


def _tree_visible(visible: jax.Array, positions: jax.Array, q_positions: jax.Array,
                  tree_mask: jax.Array) -> jax.Array:
    """visible bool [B, S, Tk] with the keys at this forward's own slots (offsets 0..S-1 from
    q_positions[:, 0]) visible by tree_mask [B, S, S] instead of by position."""
    seq = tree_mask.shape[-1]
    offset = positions[:, None, :] - q_positions[:, :1, None]  # [B, 1, Tk]
    fresh = (offset >= 0) & (offset < seq) & (positions[:, None, :] >= 0)  # [B, 1, Tk]
    index = jnp.broadcast_to(jnp.clip(offset, 0, seq - 1),
                             (q_positions.shape[0], seq, offset.shape[-1]))  # [B, S, Tk]
    ancestor = jnp.take_along_axis(tree_mask, index, axis=2)  # [B, S, Tk]
    return jnp.where(fresh, ancestor, visible)


def _matmul_f32(a: jax.Array, b: jax.Array, contract: tuple[int, int], batch: int) -> jax.Array:
    """dot_general over the leading `batch` axes of a and b, contracting a's axis contract[0]
    with b's axis contract[1]; float32 result. fp32 inputs accumulate in fp32; narrower inputs
    multiply in their own dtype (as HF does for bf16 models) and are widened after, since
    XLA:CPU has no bf16 x bf16 -> f32 kernel for every shape."""
    dims = (((contract[0],), (contract[1],)), (tuple(range(batch)), tuple(range(batch))))
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    return jax.lax.dot_general(a, b.astype(a.dtype), dims).astype(jnp.float32)


def _codes(codes: jax.Array, block: KeyBlock) -> jax.Array:
    return codes if block.unpack is None else block.unpack(codes)


def _widened(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """Codes [B, Hkv, Tk, Dh] times their group scales [B, Hkv, Tk, N] -> [B, Hkv, Tk, Dh] in
    `dtype`: one elementwise pass (XLA:CPU widens before a matmul anyway), so the products
    below are single plain matmuls with no per-group reshapes or transposes."""
    groups = scale.shape[-1]
    grouped = codes.astype(jnp.float32).reshape(codes.shape[:-1] + (groups, -1))  # [..,N,Dg]
    return (grouped * scale.astype(jnp.float32)[..., None]).reshape(codes.shape).astype(dtype)


def _scores(q_rows: jax.Array, block: KeyBlock) -> jax.Array:
    """q_rows [B, Hkv, R, Dh] (R = G*S) -> scores [B, Hkv, R, Tk] float32 (unscaled)."""
    if block.k_scale is None:
        return _matmul_f32(q_rows, block.k, (3, 3), batch=2)  # [B, Hkv, R, Tk]
    keys = _widened(_codes(block.k, block), block.k_scale, q_rows.dtype)  # [B, Hkv, Tk, Dh]
    return _matmul_f32(q_rows, keys, (3, 3), batch=2)  # [B, Hkv, R, Tk]


def _values(weights: jax.Array, block: KeyBlock, out_dtype) -> jax.Array:
    """weights [B, Hkv, R, Tk] f32 -> [B, Hkv, R, Dh] float32."""
    if block.v_scale is None:
        return _matmul_f32(weights.astype(block.v.dtype), block.v, (3, 2), batch=2)
    values = _widened(_codes(block.v, block), block.v_scale, out_dtype)  # [B, Hkv, Tk, Dh]
    return _matmul_f32(weights.astype(out_dtype), values, (3, 2), batch=2)  # [B, Hkv, R, Dh]


def attend_blocks(q: jax.Array, q_positions: jax.Array, blocks: Sequence[KeyBlock], *,
                  scale: float, window: int | None = None,
                  softcap: float | None = None, tree_mask: jax.Array | None = None
                  ) -> jax.Array:
    """Grouped-query attention of q [B, S, H, Dh] over the union of `blocks`.

    q_positions: int32 [B, S]. window: the layer's sliding window (an int, or an int32
    scalar that may be traced; None: no window). softcap: attention logit soft-capping
    (Gemma 2): scaled scores become softcap * tanh(scores / softcap) before the mask (None:
    the scores as they are). Returns [B, S, H, Dh] in q's dtype. Softmax in fp32 over
    every block's keys at once. An int8 block of at least 2 * KEY_CHUNK keys is read
    KEY_CHUNK keys per step of a loop (online softmax: each chunk's partial softmax merged
    into a running one), so its codes are widened to float one cache-resident chunk at a time
    instead of the whole layer at once (XLA:CPU does not widen inside the matmul).
    tree_mask: bool [B, S, S], a token tree's ancestor mask over this forward's own slots
    (module docs); None: positions alone decide.
    """
    _, seq, num_heads, _ = q.shape  # [B, S, H, Dh]
    if len(blocks) == 1 and tree_mask is None and _skips_chunks(blocks[0], seq):
        return _attend_query_blocks(q, q_positions, blocks[0], scale, window, softcap)
    num_kv_heads = blocks[0].num_kv_heads
    group = num_heads // num_kv_heads
    q_rows = query_rows(q, num_kv_heads)  # [B, Hkv, G*S, Dh]
    if any(_is_chunked(block) for block in blocks):
        out = _attend_partials(q_rows, q_positions, blocks, scale, window, group, softcap,
                               tree_mask)
    else:
        out = _attend_whole(q_rows, q_positions, blocks, scale, window, group, softcap,
                            tree_mask)
    return heads_out(out, q)  # [B, S, H, Dh]


def query_rows(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """q [B, S, H, Dh] -> [B, Hkv, G*S, Dh]: each KV head's G query heads and S positions
    folded into rows, group-major (row g * S + s)."""
    batch, seq, heads, dim = q.shape
    grouped = q.reshape(batch, seq, num_kv_heads, heads // num_kv_heads, dim)  # [B,S,Hkv,G,Dh]
    return jnp.transpose(grouped, (0, 2, 3, 1, 4)).reshape(
        batch, num_kv_heads, heads // num_kv_heads * seq, dim)  # [B, Hkv, G*S, Dh]


def heads_out(rows: jax.Array, q: jax.Array) -> jax.Array:
    """The inverse of `query_rows`: [B, Hkv, G*S, Dh] -> [B, S, H, Dh] in q's dtype."""
    batch, seq, heads, dim = q.shape
    kv_heads = rows.shape[1]
    out = rows.reshape(batch, kv_heads, heads // kv_heads, seq, dim)  # [B, Hkv, G, S, Dh]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(batch, seq, heads, dim).astype(q.dtype)


KEY_CHUNK = 1024  # keys per loop step of a long quantized block (chunked from 2x that)
QUERY_BLOCK = 128  # query positions per block of a long causal forward (a prefill)
CAUSAL_KEY_CHUNK = 256  # keys per loop step there
CAUSAL_MIN_QUERIES = 512  # from this many query positions on, a dense block skips key chunks


def _skips_chunks(block: KeyBlock, seq: int) -> bool:
    """A long forward (a prefill's `seq` >= CAUSAL_MIN_QUERIES positions) over one dense
    block whose key j sits at position j: `_attend_query_blocks` reads, for each block of
    queries, only the key chunks some query in it can see (about half of a prefill's
    products, and scores that stay in cache: SmolLM2's 1,024-token prefill attention ran
    3.7x faster per layer than one softmax over every key)."""
    return (block.ordered and block.k_scale is None and block.valid is None
            and block.rotation is None and block.min_age == 0 and block.max_age is None
            and seq >= CAUSAL_MIN_QUERIES)


def _attend_query_blocks(q, q_positions, block: KeyBlock, scale: float, window,
                         softcap: float | None = None) -> jax.Array:
    """`attend_blocks` of an ordered dense block, QUERY_BLOCK query positions at a time (a
    `lax.map`); each block runs an online softmax over the CAUSAL_KEY_CHUNK-key chunks
    between its lowest visible key (a sliding window's edge, else 0) and its highest query
    position (a loop with traced bounds). Returns [B, S, H, Dh] in q's dtype."""
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = block.num_kv_heads, block.num_keys
    group = num_heads // num_kv_heads
    chunk = min(CAUSAL_KEY_CHUNK, num_keys)
    chunks = -(-num_keys // chunk)
    count = -(-seq // QUERY_BLOCK)
    pad = count * QUERY_BLOCK - seq
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))  # [B, n*Q, H, Dh]
    q_positions = jnp.pad(q_positions, ((0, 0), (0, pad)), mode="edge")  # [B, n*Q]
    rows = q.reshape(batch, count, QUERY_BLOCK, num_kv_heads, group, head_dim)
    rows = jnp.transpose(rows, (1, 0, 3, 4, 2, 5)).reshape(
        count, batch, num_kv_heads, group * QUERY_BLOCK, head_dim)  # [n, B, Hkv, G*Q, Dh]
    positions = jnp.transpose(q_positions.reshape(batch, count, QUERY_BLOCK),
                              (1, 0, 2))  # [n, B, Q]

    def one_block(args):
        block_rows, block_positions = args  # [B, Hkv, G*Q, Dh], [B, Q]
        stop = jnp.clip(jnp.max(block_positions) // chunk + 1, 1, chunks)
        start = jnp.int32(0) if window is None else jnp.clip(
            (jnp.min(block_positions) - window + 1) // chunk, 0, stop - 1)

        def step(index, carry):
            begin = jnp.minimum(index * chunk, num_keys - chunk)
            part = _key_slice(block, begin, fresh_from=index * chunk, size=chunk)
            return _merge_two(carry, _partial(block_rows, block_positions, part, scale,
                                              window, group, softcap))

        _, total, acc = jax.lax.fori_loop(start, stop, step,
                                          _empty_partial(block_rows.shape))
        return acc / jnp.where(total > 0, total, 1.0)  # [B, Hkv, G*Q, Dh]

    out = jax.lax.map(one_block, (rows, positions))  # [n, B, Hkv, G*Q, Dh]
    out = out.reshape(count, batch, num_kv_heads, group, QUERY_BLOCK, head_dim)
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(batch, count * QUERY_BLOCK,
                                                         num_heads, head_dim)
    return out[:, :seq].astype(q.dtype)  # [B, S, H, Dh]


def _empty_partial(rows_shape) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The partial softmax of no keys for rows [B, Hkv, R, Dh]: (-inf, 0, 0)."""
    batch, kv_heads, rows_count, head_dim = rows_shape
    return (jnp.full((batch, kv_heads, rows_count, 1), -jnp.inf, jnp.float32),
            jnp.zeros((batch, kv_heads, rows_count, 1), jnp.float32),
            jnp.zeros((batch, kv_heads, rows_count, head_dim), jnp.float32))


def _is_chunked(block: KeyBlock) -> bool:
    """Long int8 blocks only: packed 4-bit codes unpacked inside the loop ran 2.5x slower
    than one unpack of the whole layer (benchmarks/bench_cache.py, 4k keys)."""
    return (block.k_scale is not None and block.unpack is None
            and block.num_keys >= 2 * KEY_CHUNK)


def _in_block_basis(q_rows: jax.Array, block: KeyBlock) -> jax.Array:
    """Query rows [B, Hkv, R, Dh] in the basis the block's keys are stored in (q R)."""
    return q_rows if block.rotation is None else q_rows @ block.rotation.astype(q_rows.dtype)


def _out_of_block_basis(out: jax.Array, block: KeyBlock) -> jax.Array:
    """A block's weighted values [B, Hkv, R, Dh] rotated back by R^T (float32)."""
    return out if block.rotation is None else out @ block.rotation.T


def _masked_scores(rows, q_positions, block: KeyBlock, scale: float, window, group: int,
                   softcap: float | None = None, tree_mask: jax.Array | None = None):
    """Scaled (and soft-capped, when softcap is set) scores [B, Hkv, R, Tk] of rows already
    in the block's basis, -inf where a key is invisible to the query position of that row
    (R = G*S, group-major)."""
    batch, _, rows_count, _ = rows.shape
    scores = _scores(rows, block) * scale  # [B, Hkv, R, Tk]
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)  # [B, Hkv, R, Tk]
    visible = _visible(block, q_positions, window, tree_mask)  # [B, S, Tk]
    visible = jnp.broadcast_to(visible[:, None], (batch, group) + visible.shape[1:])
    visible = visible.reshape(batch, 1, rows_count, -1)  # [B, 1, R, Tk]
    return jnp.where(visible, scores, -jnp.inf)


def _attend_whole(q_rows, q_positions, blocks, scale: float, window, group: int,
                  softcap: float | None = None, tree_mask=None) -> jax.Array:
    """Every block's scores at once, one softmax, then the values: [B, Hkv, R, Dh] f32."""
    parts = [_masked_scores(_in_block_basis(q_rows, block), q_positions, block, scale, window,
                            group, softcap, tree_mask) for block in blocks]  # each [B, Hkv, R, Tk]
    scores = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)  # [B,Hkv,R,ΣTk]
    weights = jax.nn.softmax(scores, axis=-1)  # [B, Hkv, R, ΣTk]
    out = None
    start = 0
    for block in blocks:
        size = block.num_keys
        part = weights if len(blocks) == 1 else weights[..., start:start + size]
        contribution = _out_of_block_basis(_values(part, block, q_rows.dtype), block)
        out = contribution if out is None else out + contribution
        start += size
    return out


def _attend_partials(q_rows, q_positions, blocks, scale: float, window, group: int,
                     softcap: float | None = None, tree_mask=None):
    """Each block's partial softmax (long quantized blocks chunk by chunk), merged:
    [B, Hkv, R, Dh] f32."""
    partials = []
    for block in blocks:
        chunked = _chunked_partial if _is_chunked(block) else _partial
        high, total, acc = chunked(_in_block_basis(q_rows, block), q_positions, block, scale,
                                   window, group, softcap, tree_mask)
        partials.append((high, total, _out_of_block_basis(acc, block)))
    return _merge(partials)


def _partial(rows, q_positions, block: KeyBlock, scale: float, window, group: int,
             softcap: float | None = None, tree_mask=None):
    """One block's partial softmax: (max [B, Hkv, R, 1], sum of weights [B, Hkv, R, 1],
    weighted values [B, Hkv, R, Dh]), all float32, relative to that max (R = G*S)."""
    scores = _masked_scores(rows, q_positions, block, scale, window, group,
                            softcap, tree_mask)  # [B, Hkv, R, Tk]
    high = jnp.max(scores, axis=-1, keepdims=True)  # [B, Hkv, R, 1]
    weights = jnp.exp(scores - _finite(high))  # [B, Hkv, R, Tk] (0 where invisible)
    total = jnp.sum(weights, axis=-1, keepdims=True)  # [B, Hkv, R, 1]
    return high, total, _values(weights, block, rows.dtype)


def _chunked_partial(rows, q_positions, block: KeyBlock, scale: float, window, group: int,
                     softcap: float | None = None, tree_mask=None):
    """`_partial` of a long block, KEY_CHUNK keys per step of a loop (online softmax). The
    last chunk starts at Tk - KEY_CHUNK; keys an earlier chunk already counted are masked."""
    count = -(-block.num_keys // KEY_CHUNK)

    def step(index, carry):
        begin = jnp.minimum(index * KEY_CHUNK, block.num_keys - KEY_CHUNK)
        part = _key_slice(block, begin, fresh_from=index * KEY_CHUNK, size=KEY_CHUNK)
        return _merge_two(carry, _partial(rows, q_positions, part, scale, window, group,
                                          softcap, tree_mask))

    return jax.lax.fori_loop(0, count, step, _empty_partial(rows.shape))


def _key_slice(block: KeyBlock, begin, fresh_from, size: int) -> KeyBlock:
    """Keys [begin, begin + size) of a block; keys before `fresh_from` are invalid."""
    def cut(a, axis):
        return None if a is None else jax.lax.dynamic_slice_in_dim(a, begin, size, axis)

    index = begin + jnp.arange(size, dtype=jnp.int32)  # [C]
    fresh = (index >= fresh_from)[None]  # [1, C]
    valid = fresh if block.valid is None else cut(block.valid, 1) & fresh  # [B|1, C]
    positions = block.positions
    return dataclasses.replace(
        block, k=cut(block.k, 2), v=cut(block.v, 2), k_scale=cut(block.k_scale, 2),
        v_scale=cut(block.v_scale, 2), positions=cut(positions, positions.ndim - 1),
        valid=valid, bypass=cut(block.bypass, 1))


def _finite(high: jax.Array) -> jax.Array:
    """A max over no visible key (-inf) as 0, so exp(scores - max) stays 0, not NaN."""
    return jnp.where(jnp.isfinite(high), high, 0.0)


def _merge_two(a, b):
    """Two partial softmaxes over disjoint keys -> one."""
    high = jnp.maximum(a[0], b[0])  # [B, Hkv, R, 1]
    wa, wb = jnp.exp(a[0] - _finite(high)), jnp.exp(b[0] - _finite(high))  # [B, Hkv, R, 1]
    return high, a[1] * wa + b[1] * wb, a[2] * wa + b[2] * wb


def _merge(partials) -> jax.Array:
    """Partial softmaxes -> the attention output [B, Hkv, R, Dh] float32."""
    merged = partials[0]
    for part in partials[1:]:
        merged = _merge_two(merged, part)
    _, total, acc = merged
    return acc / jnp.where(total > 0, total, 1.0)
