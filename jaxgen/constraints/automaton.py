"""A token-level automaton for constrained decoding: the arrays, the mask and the step.

A constraint (a regex, a JSON schema, a list of choices, or a host function's per-step
allowed lists) is a deterministic automaton over token ids. Each row of a batch is in one
state; before a token is chosen its scores are masked to the tokens that leave that state,
and after it is appended the row moves along the token's edge. Everything is arrays, so the
mask and the step run inside the compiled `while_loop` of every mode:

    allowed     uint32 [S, W]   W = ceil(V / 32); bit t % 32 of word t // 32: token t leaves s
    offsets     int32  [S + 1]  state s's edges are entries offsets[s] .. offsets[s+1]-1 of
    edge_tokens int32  [E]        the edges' tokens, ascending within a state,
    edge_next   int32  [E]        and the states they lead to
    final       bool   [S]      the pattern may end here: EOS is allowed exactly there
    initial     int32  []       the start state

Why this layout (SmolLM2, V = 49,152): a nested JSON schema has ~340 states and ~940k
edges. A dense [S, V] int16 transition table would be 33 MB and a decode step would read a
98 KB row per sequence; the bit-packed mask is 2 MB (6 KB per row per step) and the edges
7.5 MB, and the next state is a binary search among the chosen token's state's edges
(~16 gathers of [B] ints). Shapes are bucketed (S, E to powers of two, jaxgen.core.state
.next_pow2), and every array is a dynamic PyTree leaf: a new pattern of the same bucket
reuses the compiled program.

A token without an edge from the row's state leaves the state unchanged (EOS, the pad a
finished row writes, or a host automaton, whose rows never move: see `host_automaton`).

Example (vocabulary 6, "ab" or "a" then EOS; tokens 1 = "a", 2 = "b"):
    >>> import numpy as np, jax.numpy as jnp
    >>> aut = from_edges({0: {1: 1}, 1: {2: 2}}, initial=0, finals=[1, 2], vocab_size=6)
    >>> s = jnp.array([aut.initial.item()])
    >>> allowed_tokens(aut, s, eos_ids=(5,))[0].tolist()     # "a" only
    [False, True, False, False, False, False]
    >>> s = advance(aut, s, jnp.array([1]))
    >>> allowed_tokens(aut, s, eos_ids=(5,))[0].tolist()     # "b" or EOS (final)
    [False, False, True, False, False, True]
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MIN_STATES = 16  # smallest state bucket
MIN_EDGES = 256  # smallest edge bucket


def _bucket(n: int, low: int) -> int:
    """The next power of two >= max(n, low)."""
    return 1 << max(int(max(n, low)) - 1, 0).bit_length()


def words_for(vocab_size: int) -> int:
    """uint32 words per state's mask: ceil(V / 32)."""
    return -(-int(vocab_size) // 32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
    """The automaton's arrays (see the module docs); `vocab_size` and `eos_at_final` static.

    eos_at_final: True for compiled patterns (EOS allowed exactly at final states, whatever
    `allowed` says); False for a host function's allowed lists, which decide EOS themselves.
    """

    allowed: jax.Array  # uint32 [S, W]
    offsets: jax.Array  # int32 [S + 1]
    edge_tokens: jax.Array  # int32 [E]
    edge_next: jax.Array  # int32 [E]
    final: jax.Array  # bool [S]
    initial: jax.Array  # int32 []
    vocab_size: int = dataclasses.field(metadata=dict(static=True))
    eos_at_final: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @property
    def num_states(self) -> int:
        """The state bucket S (the real count is at most this)."""
        return self.allowed.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize
                   for a in jax.tree_util.tree_leaves(self))

    def replace(self, **changes) -> "TokenAutomaton":
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConstraintCarry:
    """What a decoding state carries: the automaton and each row's state (int32 [B])."""

    automaton: TokenAutomaton
    state: jax.Array  # int32 [B]

    def replace(self, **changes) -> "ConstraintCarry":
        return dataclasses.replace(self, **changes)


def start_carry(automaton: TokenAutomaton, batch: int) -> ConstraintCarry:
    """Every row at the automaton's initial state. The arrays are copied: a decoding state
    is donated to its call, and a cached automaton must outlive it."""
    automaton = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), automaton)
    states = jnp.broadcast_to(jnp.asarray(automaton.initial, jnp.int32), (batch,))  # [B]
    return ConstraintCarry(automaton=automaton, state=jnp.array(states, copy=True))


# ------------------------------------------------------------------- host-side builders
def pack_mask(mask) -> np.ndarray:
    """bool [N, V] -> uint32 [N, ceil(V / 32)] (bit t % 32 of word t // 32).

    >>> pack_mask(np.array([[True] + [False] * 32 + [True]])).tolist()
    [[1, 2]]
    """
    mask = np.asarray(mask, bool)
    rows, vocab = mask.shape
    padded = np.zeros((rows, words_for(vocab) * 32), bool)
    padded[:, :vocab] = mask
    packed = np.packbits(padded, axis=1, bitorder="little")  # [N, 4W] bytes, bit i = 8j + i
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)  # [N, W]


def from_arrays(sources, tokens, targets, *, initial: int, finals, num_states: int,
                vocab_size: int, eos_at_final: bool = True) -> TokenAutomaton:
    """The automaton from an edge list over dense state ids 0..num_states-1 (numpy int
    arrays [E]; one edge per (source, token)), padded to its shape bucket."""
    sources = np.asarray(sources, np.int64)
    tokens = np.asarray(tokens, np.int64)
    targets = np.asarray(targets, np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"edge tokens must lie in 0..{vocab_size - 1}")
    order = np.lexsort((tokens, sources))
    sources, tokens, targets = sources[order], tokens[order], targets[order]
    states = _bucket(num_states, MIN_STATES)
    edges = _bucket(len(tokens), MIN_EDGES)
    offsets = np.zeros((states + 1,), np.int32)  # [S + 1]
    np.cumsum(np.bincount(sources, minlength=states)[:states], out=offsets[1:])
    edge_tokens = np.zeros((edges,), np.int32)  # [E]
    edge_next = np.zeros((edges,), np.int32)  # [E]
    edge_tokens[:len(tokens)] = tokens
    edge_next[:len(targets)] = targets
    words = words_for(vocab_size)
    allowed = np.zeros((states, words), np.uint32)  # [S, W]
    np.bitwise_or.at(allowed, (sources, tokens // 32),
                     (np.uint32(1) << (tokens % 32).astype(np.uint32)))
    final = np.zeros((states,), bool)  # [S]
    final[np.asarray(list(finals), np.int64)] = True
    return TokenAutomaton(allowed=jnp.asarray(allowed), offsets=jnp.asarray(offsets),
                          edge_tokens=jnp.asarray(edge_tokens),
                          edge_next=jnp.asarray(edge_next), final=jnp.asarray(final),
                          initial=jnp.asarray(initial, jnp.int32), vocab_size=int(vocab_size),
                          eos_at_final=eos_at_final)


def from_edges(transitions: Mapping[int, Mapping[int, int]], *, initial: int,
               finals: Sequence[int], vocab_size: int) -> TokenAutomaton:
    """The automaton of {state: {token: next state}} over dense ids (a small helper for
    tests and research code; jaxgen.constraints.compile builds large ones from arrays)."""
    edges = [(s, t, n) for s, row in transitions.items() for t, n in row.items()]
    states = 1 + max([initial, *finals, *[max(s, n) for s, _, n in edges]])
    sources, tokens, targets = (np.array(column, np.int64) for column in
                                zip(*edges)) if edges else (np.zeros(0, np.int64),) * 3
    return from_arrays(sources, tokens, targets, initial=initial, finals=finals,
                       num_states=states, vocab_size=vocab_size)


def host_automaton(masks) -> TokenAutomaton:
    """A one-step automaton for a host function's allowed lists: state b allows masks[b]
    (bool [N, V]) and has no edges, so row b stays in state b and the host replaces
    `allowed` before every step (jaxgen.drivers.prefix_hook). EOS follows the mask."""
    masks = np.asarray(masks, bool)
    rows, vocab = masks.shape
    aut = from_arrays(np.zeros(0), np.zeros(0), np.zeros(0), initial=0, finals=[],
                      num_states=rows, vocab_size=vocab, eos_at_final=False)
    allowed = np.zeros(aut.allowed.shape, np.uint32)
    allowed[:rows] = pack_mask(masks)
    return aut.replace(allowed=jnp.asarray(allowed))


# ------------------------------------------------------------------- traced pieces
def allowed_tokens(automaton: TokenAutomaton, states: jax.Array,
                   eos_ids: Sequence[int] = ()) -> jax.Array:
    """bool [N, V]: the tokens each row may take next. states int32 [N]. With
    eos_at_final, the EOS ids are allowed exactly at final states."""
    vocab = automaton.vocab_size
    words = automaton.allowed[states]  # [N, W]
    shifts = jnp.arange(32, dtype=jnp.uint32)  # [32]
    bits = (words[:, :, None] >> shifts[None, None, :]) & jnp.uint32(1)  # [N, W, 32]
    mask = bits.reshape(states.shape[0], -1)[:, :vocab].astype(bool)  # [N, V]
    if automaton.eos_at_final and eos_ids:
        final = automaton.final[states]  # [N]
        eos = jnp.asarray(tuple(eos_ids), jnp.int32)  # [E_ids]
        mask = mask.at[:, eos].set(final[:, None])
    return mask


def mask_scores(automaton: TokenAutomaton, states: jax.Array, scores: jax.Array,
                eos_ids: Sequence[int] = ()) -> jax.Array:
    """scores [N, V] with every token the row's state does not allow at -inf."""
    vocab = scores.shape[-1]
    if vocab != automaton.vocab_size:
        raise ValueError(f"the constraint automaton was built for a vocabulary of "
                         f"{automaton.vocab_size} tokens but the scores have {vocab}")
    allowed = allowed_tokens(automaton, states, eos_ids)  # [N, V]
    return jnp.where(allowed, scores, -jnp.inf)


def advance(automaton: TokenAutomaton, states: jax.Array, tokens: jax.Array) -> jax.Array:
    """int32 [N]: each row's state after `tokens` [N] (unchanged where the token has no
    edge). A binary search among the state's edges, sorted by token."""
    lo = automaton.offsets[states]  # [N]
    end = automaton.offsets[states + 1]  # [N]
    hi = end
    steps = max(int(automaton.edge_tokens.shape[0]).bit_length(), 1)
    tokens = tokens.astype(jnp.int32)

    def bisect(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2  # [N]
        go_right = (automaton.edge_tokens[jnp.minimum(mid, automaton.edge_tokens.shape[0] - 1)]
                    < tokens) & (lo < hi)
        return jnp.where(go_right, mid + 1, lo), jnp.where(go_right | (lo >= hi), hi, mid)

    lo, _ = jax.lax.fori_loop(0, steps, bisect, (lo, hi))
    at = jnp.minimum(lo, automaton.edge_tokens.shape[0] - 1)  # [N]
    found = (lo < end) & (automaton.edge_tokens[at] == tokens)  # [N]
    return jnp.where(found, automaton.edge_next[at], states).astype(jnp.int32)


def advance_path(automaton: TokenAutomaton, states: jax.Array,
                 tokens: jax.Array) -> jax.Array:
    """int32 [N, K+1]: the states before each of tokens [N, K] and after the last."""
    def step(current, token):  # [N], [N]
        following = advance(automaton, current, token)
        return following, following

    _, after = jax.lax.scan(step, states, tokens.T)  # [K, N]
    return jnp.concatenate([states[:, None], after.T], axis=1)


def constrain(carry: ConstraintCarry | None, scores: jax.Array, eos_ids: Sequence[int],
              states: jax.Array | None = None) -> jax.Array:
    """scores [N, V] masked by the rows' states (carry.state unless `states` is given);
    unchanged without a constraint."""
    if carry is None:
        return scores
    return mask_scores(carry.automaton, carry.state if states is None else states, scores,
                       eos_ids)


def mask_path(carry: ConstraintCarry | None, scores: jax.Array, path: jax.Array | None,
              eos_ids: Sequence[int]) -> jax.Array:
    """scores [B, S, V] masked at each position by the state path [B, S] (the assisted
    loop's verify positions); unchanged without a constraint."""
    if carry is None:
        return scores
    batch, width, vocab = scores.shape
    flat = mask_scores(carry.automaton, path.reshape(-1), scores.reshape(batch * width, vocab),
                       eos_ids)  # [B*S, V]
    return flat.reshape(batch, width, vocab)


def step_carry(carry: ConstraintCarry | None, tokens: jax.Array,
               live: jax.Array) -> ConstraintCarry | None:
    """The carry after each live row appended tokens [B] (None stays None)."""
    if carry is None:
        return None
    moved = advance(carry.automaton, carry.state, tokens)  # [B]
    return carry.replace(state=jnp.where(live, moved, carry.state))


__all__ = ["ConstraintCarry", "TokenAutomaton", "advance", "advance_path", "allowed_tokens",
           "constrain", "from_arrays", "mask_path", "from_edges", "host_automaton", "mask_scores",
           "pack_mask", "start_carry", "step_carry", "words_for"]
