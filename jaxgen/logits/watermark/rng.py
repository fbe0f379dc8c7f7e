"""PyTorch's CPU random permutation, bit for bit, in JAX: what the green-list watermark needs
to agree with Hugging Face's WatermarkLogitsProcessor / WatermarkDetector.

`torch.Generator().manual_seed(s)` seeds a Mersenne Twister (MT19937) with the low 32 bits of
s, and `torch.randperm(n, generator=g)` (CPU, n < 2**32 / 20) is a forward Fisher-Yates
shuffle: for i = 0 .. n-2, swap r[i] with r[i + u_i % (n - i)], u_i the generator's next 32-bit
output. Position i is final after step i, so the first `count` entries of the permutation
need only `count` steps. Everything here is batched over rows, each with its own seed, and
traceable (`jax.lax` loops; no host work).

Example (torch.randperm(8, generator=torch.Generator().manual_seed(0)) is
[4, 0, 7, 3, 2, 5, 1, 6]):
    >>> import jax.numpy as jnp
    >>> randperm_prefix(jnp.array([0], jnp.uint32), 8, 8).tolist()
    [[4, 0, 7, 3, 2, 5, 1, 6]]
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_N, _M = 624, 397  # MT19937 state size and shift
_MATRIX, _UPPER, _LOWER = 0x9908B0DF, 0x80000000, 0x7FFFFFFF


def _u32(value: int) -> jax.Array:
    return jnp.uint32(value)


def mt_init(seeds: jax.Array) -> jax.Array:
    """MT19937 states [B, 624] (uint32) from 32-bit seeds [B] (init_genrand)."""
    seeds = seeds.astype(jnp.uint32)  # [B]

    def step(previous, index):
        value = _u32(1812433253) * (previous ^ (previous >> 30)) + index.astype(jnp.uint32)
        return value, value

    _, rest = jax.lax.scan(step, seeds, jnp.arange(1, _N, dtype=jnp.uint32))  # [623, B]
    return jnp.concatenate([seeds[:, None], rest.T], axis=1)  # [B, 624]


def _mix(upper: jax.Array, lower: jax.Array, far: jax.Array) -> jax.Array:
    y = (upper & _u32(_UPPER)) | (lower & _u32(_LOWER))
    return far ^ (y >> 1) ^ jnp.where((y & 1) == 1, _u32(_MATRIX), _u32(0))


def mt_twist(state: jax.Array) -> jax.Array:
    """The next MT19937 state [B, 624]: the sequential in-place twist as four vector blocks
    (entry i reads entry i + 397, already replaced when i >= 227)."""
    old = state
    a = _mix(old[:, :227], old[:, 1:228], old[:, 397:624])  # i in [0, 227)
    b = _mix(old[:, 227:454], old[:, 228:455], a)  # i in [227, 454): new[i - 227]
    c = _mix(old[:, 454:623], old[:, 455:624], b[:, :169])  # i in [454, 623)
    last = _mix(old[:, 623:], a[:, :1], b[:, 169:170])  # i = 623 wraps to new[0]
    return jnp.concatenate([a, b, c, last], axis=1)  # [B, 624]


def _temper(y: jax.Array) -> jax.Array:
    y = y ^ (y >> 11)
    y = y ^ ((y << 7) & _u32(0x9D2C5680))
    y = y ^ ((y << 15) & _u32(0xEFC60000))
    return y ^ (y >> 18)


def mt_outputs(seeds: jax.Array, count: int) -> jax.Array:
    """The first `count` 32-bit outputs [B, count] (uint32) of MT19937 seeded with `seeds`."""
    blocks = -(-count // _N)

    def twist(state, _):
        state = mt_twist(state)
        return state, _temper(state)

    _, out = jax.lax.scan(twist, mt_init(seeds), None, length=blocks)  # [blocks, B, 624]
    return jnp.moveaxis(out, 0, 1).reshape(seeds.shape[0], -1)[:, :count]  # [B, count]


def randperm_prefix(seeds: jax.Array, n: int, count: int) -> jax.Array:
    """The first `count` entries [B, count] (int32) of torch.randperm(n) under each seed [B].

    No sequential shuffle: step i swaps places i and j_i >= i, so place i ends with the item
    that sat at j_i just before step i. Place p holds, before step i, the item that sat at k
    before step k, for the latest k < i with j_k = p (else its own p). Those "latest k" links
    are found with one stable sort of the j's, and the chains they form are followed by
    pointer doubling: O(count log count) work per row, all of it vectorised.
    """
    count = min(int(count), n)
    steps = jnp.arange(count, dtype=jnp.int32)  # [S]; a last step i = n-1 swaps with itself
    draws = mt_outputs(seeds, max(count, 1))[:, :count]  # [B, S]
    j = steps + (draws % (n - steps).astype(jnp.uint32)).astype(jnp.int32)  # [B, S]
    return jax.vmap(_prefix_of_row)(j)  # [B, S]


def _prefix_of_row(j: jax.Array) -> jax.Array:
    """One row of randperm_prefix from its swap targets j [S] (1-D: gathers are plain)."""
    count = j.shape[0]
    steps = jnp.arange(count, dtype=jnp.int32)  # [S]
    order = jnp.argsort(j, stable=True)  # [S] by j, then by step
    sorted_j = j[order]  # [S]
    rank = jnp.zeros_like(order).at[order].set(steps)  # [S] place of step i in the order
    at = lambda values, where: values[jnp.clip(where, 0, count - 1)]  # noqa: E731
    # The latest k < i with j_k = j_i: i's predecessor in the stable order, if it has i's j.
    previous = rank - 1  # [S]
    to_j = jnp.where((previous >= 0) & (at(sorted_j, previous) == j), at(order, previous), -1)
    # The latest k < i with j_k = i: the last of the steps whose j is i (all have k <= i,
    # as j_k >= k), or the one before it when that last one is i itself.
    last = jnp.searchsorted(sorted_j, steps, side="right") - 1  # [S]
    last = jnp.where((last >= 0) & (at(order, last) == steps), last - 1, last)
    to_i = jnp.where((last >= 0) & (at(sorted_j, last) == steps), at(order, last), -1)
    # A_i: the item at place i just before step i: follow the links to a never-moved place.
    root = jnp.where(to_i >= 0, to_i, steps)  # [S]
    for _ in range(max(1, count).bit_length() + 1):
        root = root[root]  # pointer doubling
    moved_in = at(root, to_j)  # [S] the item the latest such step moved to j_i
    return jnp.where(j == steps, root, jnp.where(to_j >= 0, moved_in, j))  # [S]


def green_mask(seeds: jax.Array, vocab: int, green: int) -> jax.Array:
    """bool [B, V]: the first `green` ids of torch.randperm(vocab) under each seed [B]."""
    prefix = randperm_prefix(seeds, vocab, green)  # [B, G]
    rows = jnp.arange(seeds.shape[0])[:, None]  # [B, 1]
    return jnp.zeros((seeds.shape[0], vocab), bool).at[rows, prefix].set(True)  # [B, V]


def in_prefix(seeds: jax.Array, n: int, count: int, items: jax.Array) -> jax.Array:
    """bool [B]: whether items[b] is among the first `count` entries of randperm(n) under
    seeds[b]. Follows each item through the swaps (one place per row, the draws made block by
    block), so memory is O(B * 624) however large n and count are.

    >>> import jax.numpy as jnp                      # randperm(8) under seed 0: [4, 0, 7, ...]
    >>> in_prefix(jnp.array([0, 0], jnp.uint32), 8, 2, jnp.array([0, 7])).tolist()
    [True, False]
    """
    count = min(int(count), n)
    steps = min(count, n - 1)  # place n-1 needs no step: an item still unplaced lands there
    blocks = -(-steps // _N)

    def block(carry, number):
        state, place, landed = carry
        state = mt_twist(state)
        draws = _temper(state)  # [B, 624]

        def step(k, inner):
            place, landed = inner
            i = number * _N + k
            j = i + (draws[:, k] % (n - i).astype(jnp.uint32)).astype(jnp.int32)  # [B]
            live = i < steps
            landed = landed | (live & (place == j))  # moved to (or kept at) place i: final
            place = jnp.where(live & ~landed & (place == i), j, place)
            return place, landed

        place, landed = jax.lax.fori_loop(0, _N, step, (place, landed))
        return (state, place, landed), None

    start = (mt_init(seeds), items.astype(jnp.int32), jnp.zeros(items.shape, bool))
    (_, place, landed), _ = jax.lax.scan(block, start, jnp.arange(blocks, dtype=jnp.int32))
    return landed | (place < count)  # [B]
