"""Token-tree verification (`assistant_tree_nodes=N`, `assistant_tree_width=c`): tree masks
and greedy path acceptance on hand-built trees, growing trees by cumulative probability, a
tree verify forward against plain forwards of each node's path, greedy equal to plain greedy
through generate (ragged batch, one compile across prompts), a width-1 tree that is the
chain, a drafter whose second choice is right (the tree accepts where the chain cannot),
bad requests refused before compiling, and sampled acceptance: the point-mass walk on
hand-built trees (one-hot p is the greedy path, p = 0 is never accepted, every depth follows
p by chi-square) and through generate (the first three tokens' exact joint, seeded rows that
do not depend on the batch).
"""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_sampling import SMALL_V, TEMPERATURE, TOP_K, chi_square, next_probs
from test_early_exit import RAGGED
from test_mtp_assistant import (
    LLAMA,
    _tiny_vocab_target_and_drafter,
    near_bigram_drafter,
    run,
)

import jaxgen
from jaxgen.models import tiny_llama
from jaxgen.models.mtp_drafter import MtpDrafterConfig, MtpDrafterModel
from jaxgen.speculative.tree import (
    TokenTree,
    accept_greedy_path,
    accept_sampled_path,
    ancestor_mask,
    path_tokens,
    slot_depths,
)
from jaxgen.speculative.tree_growth import grow_tree

# Two rows: row 0 = root -> {3, 4}, 3 -> {5, 6}, 5 -> {7}; row 1 = a chain 10 -> 11 -> 12 plus a
# second root child 13 with child 14 (nodes listed parents first).
TREE = TokenTree(tokens=jnp.array([[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]]),
                 parent=jnp.array([[-1, -1, 0, 0, 2], [-1, 0, 1, -1, 3]]),
                 depth=jnp.array([[1, 1, 2, 2, 3], [1, 2, 3, 1, 2]]),
                 valid=jnp.ones((2, 5), bool))


# ------------------------------------------------------------------------- unit
def test_ancestor_mask_paths_and_depths_of_a_hand_built_tree():
    mask = np.asarray(ancestor_mask(TREE.parent)).astype(int)
    # row 0, slots: root, 3, 4, 5, 6, 7; slot 5 (token 7) sees root, 3, 5, 7
    assert mask[0].tolist() == [[1, 0, 0, 0, 0, 0],
                                [1, 1, 0, 0, 0, 0],
                                [1, 0, 1, 0, 0, 0],
                                [1, 1, 0, 1, 0, 0],
                                [1, 1, 0, 0, 1, 0],
                                [1, 1, 0, 1, 0, 1]]
    assert mask[1, 3].tolist() == [1, 1, 1, 1, 0, 0]  # 12 sees 10, 11
    assert mask[1, 5].tolist() == [1, 0, 0, 0, 1, 1]  # 14 sees 13
    assert np.asarray(slot_depths(TREE)).tolist() == [[0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 1, 2]]
    paths = np.asarray(path_tokens(TREE, 3))
    assert paths[0].tolist() == [[0, 0, 0], [3, 0, 0], [4, 0, 0], [3, 5, 0], [3, 6, 0],
                                 [3, 5, 7]]
    assert paths[1, 3].tolist() == [10, 11, 12] and paths[1, 5].tolist() == [13, 14, 0]


@pytest.mark.parametrize("target, n, path, fix", [
    # root says 3, at 3 says 6, at 6 says 9: path 3 -> 6, then 9
    ([3, 6, 0, 0, 9, 0], [2, 0], [0, 1, 4, 0], [9, 0]),
    # root says 4 (the second child), 4 says 8: one node, then 8
    ([4, 0, 8, 0, 0, 0], [1, 0], [0, 2, 0, 0], [8, 0]),
    # root says 2 (no child): nothing accepted, the fix is 2
    ([2, 5, 0, 0, 0, 0], [0, 0], [0, 0, 0, 0], [2, 0]),
    # the full depth: 3 -> 5 -> 7, then the target's token after 7
    ([3, 5, 0, 7, 0, 1], [3, 0], [0, 1, 3, 5], [1, 0]),
])
def test_greedy_path_acceptance_on_hand_built_trees(target, n, path, fix):
    row1 = [13, 0, 0, 0, 14, 0]  # row 1: the second root child 13, then 14: n = 2
    got_n, got_path, got_fix = accept_greedy_path(TREE, jnp.array([target, row1]), 3)
    assert np.asarray(got_n).tolist() == [n[0], 2]
    assert np.asarray(got_path)[0].tolist() == path
    assert np.asarray(got_path)[1].tolist() == [0, 4, 5, 0]
    assert np.asarray(got_fix).tolist() == [fix[0], 0]


def test_acceptance_needs_every_ancestor_and_a_valid_node():
    # 5 matches what 3 says, but 3 is not what the root says: 5 is not accepted
    target = jnp.array([[4, 5, 0, 0, 0, 0], [0] * 6])
    n, _, fix = accept_greedy_path(TREE, target, 3)
    assert int(n[0]) == 1 and int(fix[0]) == 0  # 4 accepted, then what 4 says (0)
    # an invalid node (outside the budget) is never accepted, even when it matches
    invalid = dataclasses.replace(TREE, valid=TREE.valid.at[0, 2].set(False))
    n, _, fix = accept_greedy_path(invalid, jnp.array([[3, 5, 0, 7, 0, 1], [0] * 6]), 3)
    assert int(n[0]) == 1 and int(fix[0]) == 5


def test_grown_trees_keep_the_best_nodes_and_their_parents():
    vocab = 6
    probs = jax.random.dirichlet(jax.random.key(0), jnp.ones(vocab), (vocab,))  # [V, V]

    def expand(tokens, states):  # a bigram drafter: log q(next | token)
        return jnp.log(probs[tokens]), states

    root = jnp.array([0, 3])
    tree = jax.jit(lambda r: grow_tree(expand, r, jnp.zeros((2, 1)), nodes=7, width=2,
                                       depth=3))(root)
    tokens, parent, depth = (np.asarray(a) for a in (tree.tokens, tree.parent, tree.depth))
    assert tokens.shape == (2, 7) and bool(tree.valid.all())
    p = np.asarray(probs)
    for b in range(2):
        scores = []
        for i in range(7):
            assert parent[b, i] < i  # parents first
            up = parent[b, i]
            assert depth[b, i] == (1 if up < 0 else depth[b, up] + 1)
            prev = int(root[b]) if up < 0 else tokens[b, up]
            scores.append(np.log(p[prev, tokens[b, i]]) + (0 if up < 0 else scores[up]))
        assert np.all(np.diff(scores) <= 1e-6)  # best first
        top2 = np.argsort(-p[int(root[b])])[:2]
        assert sorted(tokens[b][depth[b] == 1]) == sorted(top2)  # the root's top-2
    # a width-1 tree is the greedy chain
    chain = jax.jit(lambda r: grow_tree(expand, r, jnp.zeros((2, 1)), nodes=8, width=1,
                                        depth=3))(root)
    assert chain.tokens.shape == (2, 3) and np.asarray(chain.parent).tolist() == [[-1, 0, 1]] * 2
    t = int(root[0])
    for i in range(3):
        t = int(np.argmax(p[t]))
        assert int(chain.tokens[0, i]) == t


# ------------------------------------------------------------------------- forward
def test_tree_forward_logits_equal_plain_forwards_of_each_path():
    model, params = LLAMA
    forward = jax.jit(model.__call__)
    prompts = np.array([[5, 9, 11, 5, 9, 3, 2, 1], [7, 3, 8, 1, 0, 0, 0, 0]])
    length = np.array([8, 4])  # ragged: row 1's stale prompt slots must not leak in
    batch, width = prompts.shape
    cache = forward(params, jnp.asarray(prompts[:, :-1]),
                  jnp.broadcast_to(jnp.arange(width - 1), (batch, width - 1)),
                  model.init_cache(batch, 32)).cache
    root = jnp.asarray(prompts[np.arange(batch), length - 1])[:, None]  # [B, 1]
    tokens = jnp.concatenate([root, TREE.tokens], axis=1)  # [B, 6]
    slots = jnp.asarray(length - 1)[:, None] + jnp.arange(6)[None, :]
    out = forward(params, tokens, slots, cache, tree_mask=ancestor_mask(TREE.parent))
    assert np.asarray(out.cache.length).tolist() == (length + 5).tolist()
    paths, depths = np.asarray(path_tokens(TREE, 3)), np.asarray(slot_depths(TREE))
    # every node's prefix as one right-padded causal batch: the logits at its last token
    seqs = [list(prompts[b, :length[b]]) + list(paths[b, s, :depths[b, s]])
            for b in range(batch) for s in range(6)]
    longest = max(map(len, seqs))
    padded = jnp.asarray([seq + [0] * (longest - len(seq)) for seq in seqs])  # [12, Lmax]
    ends = jnp.asarray([[len(seq) - 1] for seq in seqs])  # [12, 1]
    plain = forward(params, padded, jnp.broadcast_to(jnp.arange(longest), padded.shape),
                  model.init_cache(len(seqs), longest), logits_index=ends).logits[:, 0]
    np.testing.assert_allclose(out.logits.reshape(len(seqs), -1), plain, atol=2e-5, rtol=1e-5)
    # a chain's mask (lower triangular) is the plain causal forward
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool)), (batch, 6, 6))
    causal = forward(params, tokens, slots, cache)
    masked = forward(params, tokens, slots, cache, tree_mask=chain)
    np.testing.assert_allclose(masked.logits, causal.logits, atol=1e-6)


def test_moving_slots_puts_the_path_in_place():
    model, _ = LLAMA
    cache = model.init_cache(1, 8)
    k = jnp.arange(8.0)[None, None, None, :, None] * jnp.ones(cache.k.shape)  # slot j holds j
    cache = dataclasses.replace(cache, k=k, v=k + 100)
    moved = cache.move_slots(jnp.array([[2, 5, 7]]), jnp.array([[2, 3, 4]]))
    assert np.asarray(moved.k[1, 0, 0, :, 0]).tolist() == [0, 1, 2, 5, 7, 5, 6, 7]
    assert np.asarray(moved.v[0, 0, 1, :, 0]).tolist() == [100, 101, 102, 105, 107, 105,
                                                          106, 107]


# ------------------------------------------------------------------------- generate
def tree_config(max_new=16, nodes=8, width=2, depth=3, **fields):
    return jaxgen.GenerationConfig(max_new_tokens=max_new, num_assistant_tokens=depth,
                                   assistant_tree_nodes=nodes, assistant_tree_width=width,
                                   **fields)


def test_greedy_equals_plain_greedy_ragged_batch_and_compiles_once():
    assistant = near_bigram_drafter(LLAMA[0], kv_layers=(2, 0))
    plain = run(LLAMA, jaxgen.GenerationConfig(max_new_tokens=16), RAGGED)
    out = run(LLAMA, tree_config(), RAGGED, assistant)
    chex.assert_trees_all_equal(out.sequences, plain.sequences)
    chex.assert_trees_all_equal(out.lengths, plain.lengths)
    stats = out.speculative
    accepted, drafted = np.asarray(stats.accepted), np.asarray(stats.drafted)
    assert 0 < accepted.sum() < drafted.sum()  # paths accepted, nodes rejected
    assert (np.asarray(stats.rounds) > 0).all()
    assert int(stats.target_forwards) == int(np.max(stats.rounds)) + 1
    assert int(stats.verified_positions) == 9 * int(np.max(stats.rounds))  # N + 1 per round
    # other prompts in the same bucket, other drafter weights: nothing recompiles
    before = jaxgen.trace_count()
    other = near_bigram_drafter(LLAMA[0], seed=2, kv_layers=(2, 0))
    prompts = [[1, 2, 3], [4], list(range(8, 25)), [30, 31]]
    again = run(LLAMA, tree_config(), prompts, other)
    assert jaxgen.trace_count() == before
    plain = run(LLAMA, jaxgen.GenerationConfig(max_new_tokens=16), prompts)
    chex.assert_trees_all_equal(again.sequences, plain.sequences)


# A target whose next token depends on the current token only (no attention output), and a
# drafter that knows it but proposes its second choice first: a chain of its first choices
# is (almost) never accepted, a width-2 tree holds the right path.
BIGRAM = tiny_llama(seed=7, num_layers=2, vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_heads=4, num_kv_heads=2)
BIGRAM = (BIGRAM[0], {**BIGRAM[1], "layers": {**BIGRAM[1]["layers"],
                                              "wo": jnp.zeros_like(BIGRAM[1]["layers"]["wo"])}})


@dataclasses.dataclass(frozen=True)
class SecondChoiceDrafter(MtpDrafterModel):
    """g = the target's own state after the token (exact for BIGRAM); its logits swap the
    target's first and second choices."""

    def project(self, params, target, target_params, tokens, hidden, positions, cache):
        batch, seq = tokens.shape
        x = target.embed(target_params, tokens)  # [B, S, D]
        own = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
        x, _ = target.run_layers(target_params, x, own, target.init_cache(batch, seq), 0,
                                 target.config.num_layers)
        return x  # [B, S, D]

    def vocab_logits(self, params, target, target_params, g):
        logits = target.head(target_params, g if g.ndim == 3 else g[:, None])  # [B, S, V]
        logits = logits if g.ndim == 3 else logits[:, 0]  # [..., V]
        values, index = jax.lax.top_k(logits, 2)  # [..., 2]
        first = jax.nn.one_hot(index[..., 0], logits.shape[-1], dtype=bool)
        second = jax.nn.one_hot(index[..., 1], logits.shape[-1], dtype=bool)
        return jnp.where(first, values[..., 1:2], jnp.where(second, values[..., :1], logits))


def second_choice_drafter():
    target = BIGRAM[0]
    config = MtpDrafterConfig.for_target(target.config, hidden_size=8, intermediate_size=8,
                                         num_layers=1,
                                         draft_vocab=tuple(range(target.vocab_size)))
    model = SecondChoiceDrafter(config)
    return model, model.init_params(jax.random.key(0))


def test_a_tree_accepts_the_second_choice_a_chain_cannot():
    prompts = RAGGED[:2]
    assistant = second_choice_drafter()
    chain_cfg = jaxgen.GenerationConfig(max_new_tokens=12, num_assistant_tokens=2,
                                        assistant_confidence_threshold=0.0,
                                        assistant_fallback=False)
    chain = run(BIGRAM, chain_cfg, prompts, assistant)  # greedy: plain greedy's tokens
    tree = run(BIGRAM, tree_config(max_new=12, nodes=6, width=2, depth=2), prompts, assistant)
    chex.assert_trees_all_equal(tree.sequences, chain.sequences)
    per_round = {name: np.asarray(o.speculative.accepted).sum()
                 / np.asarray(o.speculative.rounds).sum() for name, o in
                 [("chain", chain), ("tree", tree)]}
    assert per_round["chain"] < 0.2 and per_round["tree"] > 1.5, per_round
    assert (np.asarray(tree.speculative.accepted) >= np.asarray(chain.speculative.accepted)
            ).all()


@pytest.mark.slow
def test_a_width_one_tree_is_the_chain():
    assistant = near_bigram_drafter(LLAMA[0], kv_layers=(2, 0), scale=0.3)
    chain_cfg = jaxgen.GenerationConfig(max_new_tokens=24, num_assistant_tokens=4,
                                        assistant_confidence_threshold=0.0,
                                        assistant_fallback=False)
    chain = run(LLAMA, chain_cfg, RAGGED, assistant)
    tree = run(LLAMA, chain_cfg.replace(assistant_tree_nodes=8, assistant_tree_width=1),
               RAGGED, assistant)
    wide = run(LLAMA, chain_cfg.replace(assistant_tree_nodes=16, assistant_tree_width=3),
               RAGGED, assistant)
    for out in (tree, wide):
        chex.assert_trees_all_equal(out.sequences, chain.sequences)
    for field in ("rounds", "accepted", "position_accepted"):
        chex.assert_trees_all_equal(getattr(tree.speculative, field),
                                    getattr(chain.speculative, field))
    assert int(np.sum(wide.speculative.accepted)) > int(np.sum(chain.speculative.accepted))


# ------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("fields, needle", [
    (dict(assistant_tree_nodes=0), r"`assistant_tree_nodes` must be None .* \[1, 64\]"),
    (dict(assistant_tree_nodes=65), r"`assistant_tree_nodes`=65 is out of range"),
    (dict(assistant_tree_nodes=2.5), r"`assistant_tree_nodes` must be"),
    (dict(assistant_tree_width=0), r"`assistant_tree_width` must be an int in \[1, 8\]"),
    (dict(assistant_tree_width=9), r"`assistant_tree_width`=9 is out of range"),
    (dict(assistant_tree_nodes=8, assistant_ensemble_weight=0.5), r"assistant_ensemble_weight"),
])
def test_bad_field_values_are_refused(fields, needle):
    with pytest.raises(ValueError, match=needle):
        jaxgen.GenerationConfig(**fields)


def test_requests_a_tree_cannot_run_fail_before_compiling():
    assistant = near_bigram_drafter(LLAMA[0])
    cfg = tree_config(max_new=4)
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=r"`assistant_tree_nodes`=8 applies to assisted "
                                         r"decoding with an MTP drafter"):
        run(LLAMA, cfg, RAGGED)
    with pytest.raises(ValueError, match=r"`assistant_tree_nodes`=8 needs an MTP drafter "
                                         r"assistant.*DraftModelDrafter drafts chains only"):
        run(LLAMA, cfg, RAGGED, LLAMA)  # a draft model (prompt lookup drafts trees too)
    with pytest.raises(ValueError, match=r"needs a dense KV cache.*'quantized'"):
        run(LLAMA, cfg.replace(cache_implementation="quantized"), RAGGED, assistant)
    windowed = tiny_llama(seed=4, num_layers=3, vocab_size=64, hidden_size=32,
                          intermediate_size=64, num_heads=4, num_kv_heads=2, sliding_window=8)
    with pytest.raises(ValueError, match=r"sliding-window attention"):
        run(windowed, cfg, RAGGED, near_bigram_drafter(windowed[0]))
    assert jaxgen.trace_count() == before


# ------------------------------------------------------------------------- sampling
def sampled(tree, scores, rows, seed=0, depth=3):
    """accept_sampled_path over `rows` copies of each row of tree / scores, one key each:
    (n, path, fix) with a leading [rows * B] axis (copy-major)."""
    batch = tree.tokens.shape[0]

    def tile(a):
        return jnp.tile(a, (rows,) + (1,) * (a.ndim - 1))

    many = jax.tree_util.tree_map(tile, tree)
    keys = jax.random.split(jax.random.key(seed), 2)
    uniforms = jax.random.uniform(keys[0], (rows * batch, tree.num_nodes))  # [R*B, N]
    fix_keys = jax.random.split(keys[1], rows * batch)
    accept = jax.jit(lambda *args: accept_sampled_path(*args, max_depth=depth))
    return accept(many, tile(scores), uniforms, fix_keys)


@pytest.mark.parametrize("target", [[3, 6, 0, 0, 9, 0], [4, 0, 8, 0, 0, 0],
                                    [2, 5, 0, 0, 0, 0], [3, 5, 0, 7, 0, 1]])
def test_one_hot_sampling_accepts_exactly_the_matching_path(target):
    targets = jnp.array([target, [13, 0, 0, 0, 14, 0]])  # [B, N+1]
    scores = jnp.where(jax.nn.one_hot(targets, 16, dtype=bool), 0.0, -jnp.inf)  # [B, N+1, V]
    want = [np.asarray(a) for a in accept_greedy_path(TREE, targets, 3)]
    got = [np.asarray(a) for a in sampled(TREE, scores, rows=64)]
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, np.tile(w, (64,) + (1,) * (w.ndim - 1)))


def test_sampled_walk_draws_every_depth_from_p_and_never_accepts_p_zero():
    """TREE with random p at every slot: the depth-1 token follows p at the root and the
    depth-2 token after the first root child follows p at its slot (chi-square), in row 0
    (root -> {3, 4}, 3 -> {5, 6}, 5 -> {7}; 4 has p = 0 at the root, 6 has p = 0 after 3, 7
    is invalid: never accepted) and row 1 (root -> {10, 13}, both likely: the second child's
    test must see what is left after the first's rejection)."""
    vocab, rows = 16, 20000
    tree = dataclasses.replace(TREE, valid=TREE.valid.at[0, 4].set(False))
    scores = jax.random.normal(jax.random.key(1), (2, 6, vocab))  # [B, N+1, V]
    scores = scores.at[0, 0, 4].set(-jnp.inf).at[0, 1, 6].set(-jnp.inf)
    scores = scores.at[0, 0, 3].set(3.0).at[0, 1, 5].set(3.0)  # accepted often enough
    scores = scores.at[1, 0, 10].set(2.5).at[1, 0, 13].set(2.5).at[1, 1, 11].set(3.0)
    p = np.exp(np.asarray(scores, np.float64))
    p = p / p.sum(-1, keepdims=True)  # [B, N+1, V]
    n, path, fix = (np.asarray(a).reshape((rows, 2) + np.shape(a)[1:])
                    for a in sampled(tree, scores, rows))  # [R, B, ...]
    for b in range(2):
        node_token = np.asarray(tree.tokens[b])[np.maximum(path[:, b], 1) - 1]  # [R, D+1]
        first = np.where(n[:, b] >= 1, node_token[:, 1], fix[:, b])  # [R]
        assert chi_square(np.bincount(first, minlength=vocab), p[b, 0]) > 1e-3
        after = path[:, b, 1] == 1  # [R] the first root child (slot 1) accepted
        second = np.where(n[:, b] >= 2, node_token[:, 2], fix[:, b])[after]
        assert chi_square(np.bincount(second, minlength=vocab), p[b, 1]) > 1e-3
        assert 0.2 < np.mean(after) < 0.8 and np.mean(n[:, b] >= 2) > 0.1
    assert not np.any(path[:, 0] == 2) and not np.any(path[:, 0] == 4)  # 4, 6: p = 0
    assert not np.any(path[:, 0] == 5) and n[:, 0].max() == 2  # 7 is invalid
    assert np.mean(path[:, 1, 1] == 4) > 0.1  # row 1: 13 tested after 10's rejection


@pytest.mark.slow
def test_sampling_with_a_tree_is_lossless():
    """A tiny-vocabulary target and MTP drafter, a tree of 6 nodes (width 2, depth 3): the
    first three new tokens (the prefill's, then the first round's depths 1 and 2) follow
    the exact joint, and so do the first and second tokens' marginals."""
    (model, params), assistant = _tiny_vocab_target_and_drafter()
    prompt, rows = [2, 3, 2, 3, 2], 4000
    cfg = tree_config(max_new=5, nodes=6, width=2, depth=3, do_sample=True,
                      temperature=TEMPERATURE, top_k=TOP_K)
    out = run((model, params), cfg, [prompt] * rows, assistant, key=jax.random.key(11))
    p1 = next_probs(model, params, [prompt])[0]  # [V]
    p2 = next_probs(model, params, [prompt + [a] for a in range(SMALL_V)])  # [V, V]
    p3 = next_probs(model, params, [prompt + [a, b] for a in range(SMALL_V)
                                    for b in range(SMALL_V)]).reshape((SMALL_V,) * 3)
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [V, V, V]
    new = np.asarray(out.sequences)[:, len(prompt):len(prompt) + 3]  # [rows, 3]
    counts = np.zeros((SMALL_V,) * 3)
    np.add.at(counts, (new[:, 0], new[:, 1], new[:, 2]), 1)
    assert chi_square(counts.sum((1, 2)), p1) > 1e-3
    assert chi_square(counts.sum((0, 2)), p1 @ p2) > 1e-3  # sum_a p(a) p(. | a)
    assert chi_square(counts, joint) > 1e-3
    stats = out.speculative
    accepted, drafted = int(np.sum(stats.accepted)), int(np.sum(stats.drafted))
    assert 0 < accepted < drafted  # some nodes accepted, some rejected
    assert int(np.sum(np.asarray(stats.position_accepted)[:, 1])) > 0  # depth 2 accepted


def test_seeded_tree_sampling_is_reproducible_and_rows_do_not_depend_on_their_neighbours():
    cfg = tree_config(max_new=12, nodes=8, width=2, depth=3, do_sample=True, temperature=0.9)
    assistant = near_bigram_drafter(LLAMA[0], kv_layers=(2, 0))
    keys = jax.random.split(jax.random.key(5), len(RAGGED))
    batched = run(LLAMA, cfg, RAGGED, assistant, key=keys)
    again = run(LLAMA, cfg, RAGGED, assistant, key=keys)
    chex.assert_trees_all_equal(again.sequences, batched.sequences)
    order = [2, 0, 3, 1]  # the same rows (and keys) in another order: the same program
    before = jaxgen.trace_count()
    moved = run(LLAMA, cfg, [RAGGED[b] for b in order], assistant, key=keys[np.array(order)])
    assert jaxgen.trace_count() == before
    tokens, lengths = np.asarray(batched.sequences), np.asarray(batched.lengths)
    for i, b in enumerate(order):
        n = int(lengths[b])
        assert int(moved.lengths[i]) == n
        np.testing.assert_array_equal(np.asarray(moved.sequences)[i, :n], tokens[b, :n])
    stats = batched.speculative
    assert 0 < int(np.sum(stats.accepted)) < int(np.sum(stats.drafted))
    other = run(LLAMA, cfg, RAGGED, assistant, key=jax.random.split(jax.random.key(6), 4))
    assert not np.array_equal(np.asarray(other.sequences), tokens)  # the key matters


@pytest.mark.slow
def test_a_sampled_tree_row_equals_the_row_run_alone():
    cfg = tree_config(max_new=12, nodes=8, width=2, depth=3, do_sample=True, temperature=0.9)
    assistant = near_bigram_drafter(LLAMA[0], kv_layers=(2, 0))
    keys = jax.random.split(jax.random.key(5), len(RAGGED))
    tokens = np.asarray(run(LLAMA, cfg, RAGGED, assistant, key=keys).sequences)
    for b, prompt in enumerate(RAGGED):
        alone = np.asarray(run(LLAMA, cfg, [prompt], assistant, key=keys[b:b + 1]).sequences)
        n = len(prompt) + 12
        np.testing.assert_array_equal(alone[0, :n], tokens[b, :n])
