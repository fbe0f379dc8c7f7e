"""Prompt lookup drafting token trees (`prompt_lookup_num_tokens=K`, `assistant_tree_nodes=N`,
`assistant_tree_width=c`): tries of continuations on hand-built rows (a shared prefix, no
match, a breadth-first cut), every tree equal to a plain-Python reference on random rows, a
width-1 tree equal to the chain's lookup, greedy equal to plain greedy through generate
(ragged batch, one compile across prompts), and a prompt whose first match is wrong and a
later one right (the tree accepts where the chain cannot).
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_early_exit import RAGGED
from test_mtp_assistant import LLAMA, run

import jaxgen
from jaxgen.api.plan import make_plan
from jaxgen.speculative.drafters.prompt_lookup import lookup_drafts
from jaxgen.speculative.drafters.prompt_lookup_tree import (
    PromptLookupTreeDrafter,
    lookup_tree,
)

build_tree = functools.partial(jax.jit, static_argnames=(
    "num_tokens", "max_ngram", "eos_ids", "nodes", "width"))(lookup_tree)


def as_lists(tree):
    return tuple(np.asarray(a).tolist() for a in (tree.tokens, tree.parent, tree.depth,
                                                   tree.valid))


def reference_tree(row, length, *, num_tokens, max_ngram, eos_ids, nodes, width):
    """The module's rules written out in Python, one row: (tokens, parent, depth, valid)."""
    candidates = []
    for p in range(1, length):
        n = 0
        while n < max_ngram and p - n - 1 >= 0 and row[p - n - 1] == row[length - n - 1]:
            n += 1
        follow = []
        for t in row[p:min(p + num_tokens, length)]:
            if t in eos_ids:
                break
            follow.append(t)
        if n and follow:
            candidates.append((-n, p, tuple(follow)))  # longest n, then the earliest p
    picked = []
    for _, _, follow in sorted(candidates):
        if len(picked) < width and not any(follow == q[:len(follow)] for q in picked):
            picked.append(follow)
    order = []  # prefixes, breadth first, then by the first continuation holding them
    for d in range(1, num_tokens + 1):
        for q in picked:
            if len(q) >= d and q[:d] not in order:
                order.append(q[:d])
    order = order[:nodes]
    pad = nodes - len(order)
    return ([q[-1] for q in order] + [0] * pad,
            [order.index(q[:-1]) if len(q) > 1 else -1 for q in order] + [-1] * pad,
            [len(q) for q in order] + [1] * pad,
            [True] * len(order) + [False] * pad)


# ------------------------------------------------------------------------- unit
def test_two_matches_sharing_a_prefix_make_one_path_then_siblings():
    # "5 6" is followed by 7 8 4 at 2 and by 7 8 9 at 8; "9 5 6" (n = 3) matches nowhere
    row = [5, 6, 7, 8, 4, 1, 5, 6, 7, 8, 9, 2, 9, 5, 6]
    tree = build_tree(jnp.array([row]), jnp.array([len(row)]), num_tokens=3, max_ngram=3,
                       eos_ids=(), nodes=6, width=2)
    tokens, parent, depth, valid = as_lists(tree)
    assert tokens == [[7, 8, 4, 9, 0, 0]]  # 7 -> 8 shared, then the siblings 4 and 9
    assert parent == [[-1, 0, 1, 1, -1, -1]]
    assert depth == [[1, 2, 3, 3, 1, 1]]
    assert valid == [[True, True, True, True, False, False]]
    assert int(tree.forwards) == 0


def test_a_row_without_a_match_gets_an_all_invalid_tree():
    rows = jnp.array([[1, 2, 3, 4, 5, 0], [1, 2, 1, 0, 0, 0]])  # row 0: 5 never occurred before
    tree = build_tree(rows, jnp.array([5, 3]), num_tokens=2, max_ngram=2, eos_ids=(),
                       nodes=4, width=2)
    tokens, parent, depth, valid = as_lists(tree)
    assert valid == [[False] * 4, [True, True, False, False]]  # row 1: "1" -> 2 1
    assert tokens[1][:2] == [2, 1] and parent[1][:2] == [-1, 0]
    assert parent[0] == [-1] * 4 and depth[0] == [1] * 4
    # an EOS right after every match leaves nothing to propose either
    tree = build_tree(rows, jnp.array([5, 3]), num_tokens=2, max_ngram=2, eos_ids=(2,),
                       nodes=4, width=2)
    assert np.asarray(tree.valid).tolist() == [[False] * 4] * 2


def test_more_nodes_than_n_are_cut_breadth_first_and_keep_parents():
    # "3" is followed by 4 5 6 (at 1), 7 8 9 (at 5), 1 2 4 (at 9), 4 5 0 (at 13: a 4 5 prefix)
    row = [3, 4, 5, 6, 3, 7, 8, 9, 3, 1, 2, 4, 3, 4, 5, 0, 3]
    full = build_tree(jnp.array([row]), jnp.array([len(row)]), num_tokens=3, max_ngram=1,
                       eos_ids=(), nodes=12, width=4)
    tokens, parent, depth, valid = as_lists(full)
    assert tokens[0][:10] == [4, 7, 1, 5, 8, 2, 6, 9, 4, 0]  # depth 1, 2, then 3
    assert parent[0][:10] == [-1, -1, -1, 0, 1, 2, 3, 4, 5, 3]
    assert valid[0] == [True] * 10 + [False] * 2
    cut = build_tree(jnp.array([row]), jnp.array([len(row)]), num_tokens=3, max_ngram=1,
                      eos_ids=(), nodes=5, width=4)
    tokens, parent, depth, valid = as_lists(cut)
    assert tokens == [[4, 7, 1, 5, 8]] and parent == [[-1, -1, -1, 0, 1]]
    assert depth == [[1, 1, 1, 2, 2]] and valid == [[True] * 5]


def test_longer_ngrams_rank_first_then_the_earliest_match():
    # the last 2-gram "2 3" occurred once, followed by 9; "3" alone first occurred followed by 4
    row = [3, 4, 4, 4, 4, 2, 3, 9, 9, 2, 3]
    tree = build_tree(jnp.array([row]), jnp.array([len(row)]), num_tokens=1, max_ngram=2,
                       eos_ids=(), nodes=2, width=2)
    assert np.asarray(tree.tokens).tolist() == [[9, 4]]
    tree = build_tree(jnp.array([row]), jnp.array([len(row)]), num_tokens=1, max_ngram=1,
                       eos_ids=(), nodes=2, width=2)
    assert np.asarray(tree.tokens).tolist() == [[4, 9]]


@pytest.mark.parametrize("width, nodes, eos_ids", [(1, 4, ()), (2, 5, (2,)), (3, 12, ()),
                                                    (4, 7, (0, 3))])
def test_trees_equal_the_reference_on_random_rows(width, nodes, eos_ids):
    rng = np.random.default_rng(width)
    rows = rng.integers(0, 5, size=(16, 20))  # a small vocabulary: many matches
    length = rng.integers(1, 21, size=16)
    K = 4
    drafter = PromptLookupTreeDrafter.build(depth=K, max_ngram=3, nodes=nodes, width=width)
    got = build_tree(jnp.asarray(rows, jnp.int32), jnp.asarray(length, jnp.int32),
                     num_tokens=K, max_ngram=3, eos_ids=eos_ids, nodes=drafter.nodes,
                     width=width)
    got = as_lists(got)
    for b in range(16):
        want = reference_tree(rows[b].tolist(), int(length[b]), num_tokens=K, max_ngram=3,
                              eos_ids=eos_ids, nodes=drafter.nodes, width=width)
        assert tuple(g[b] for g in got) == want, b


def test_a_width_one_tree_is_the_chain_lookup():
    rng = np.random.default_rng(7)
    rows = jnp.asarray(rng.integers(0, 6, size=(32, 24)), jnp.int32)
    length = jnp.asarray(rng.integers(2, 25, size=32), jnp.int32)
    chain = jax.jit(functools.partial(lookup_drafts, num_tokens=3, max_ngram=2, eos_ids=()))
    drafts, k_row = chain(rows, length, k_cap=jnp.full((32,), 3))
    tree = build_tree(rows, length, num_tokens=3, max_ngram=2, eos_ids=(), nodes=3, width=1)
    valid = np.asarray(tree.valid)
    assert (np.asarray(tree.parent) == np.arange(3) - 1)[valid].all()  # a chain
    assert (np.asarray(tree.depth) == np.arange(1, 4))[valid].all()
    assert valid.sum(axis=1).tolist() == np.asarray(k_row).tolist()
    assert ((np.asarray(tree.tokens) == np.asarray(drafts)) | ~valid).all()
    assert (np.asarray(k_row) > 0).sum() > 10  # the rows do match


def test_the_plan_picks_the_tree_drafter_and_caps_its_nodes():
    cfg = jaxgen.GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=3,
                                  assistant_tree_nodes=64, assistant_tree_width=2)
    plan = make_plan(jaxgen.init_state(LLAMA[0], [[1, 2, 1]], cfg), cfg)
    drafter = plan.loop.drafter
    assert type(plan.loop).__name__ == "TreeLoop"
    assert drafter == PromptLookupTreeDrafter(num_tokens=3, max_ngram=2, nodes=6, width=2)


# ------------------------------------------------------------------------- generate
# One tree program serves both generate tests (same model, config statics, batch and
# buckets; the budget is dynamic).
TREE_CFG = jaxgen.GenerationConfig(max_new_tokens=16, prompt_lookup_num_tokens=3,
                                   max_matching_ngram_size=1, assistant_fallback=False,
                                   assistant_tree_nodes=8, assistant_tree_width=2)


def test_greedy_equals_plain_greedy_ragged_batch_and_compiles_once():
    plain = run(LLAMA, jaxgen.GenerationConfig(max_new_tokens=16), RAGGED)
    out = run(LLAMA, TREE_CFG, RAGGED)
    chex.assert_trees_all_equal(out.sequences, plain.sequences)
    chex.assert_trees_all_equal(out.lengths, plain.lengths)
    stats = out.speculative
    assert 0 < int(np.sum(stats.accepted)) < int(np.sum(stats.drafted))
    assert int(stats.verified_positions) == 7 * int(np.max(stats.rounds))  # N = 2 * 3 cap
    assert int(np.sum(stats.draft_forwards)) == 0
    before = jaxgen.trace_count()
    prompts = [[1, 2, 3], [4], list(range(8, 25)), [30, 31]]
    again = run(LLAMA, TREE_CFG, prompts)
    assert jaxgen.trace_count() == before
    plain = run(LLAMA, jaxgen.GenerationConfig(max_new_tokens=16), prompts)
    chex.assert_trees_all_equal(again.sequences, plain.sequences)


# LLAMA without attention output: its next token depends on the current token only.
BIGRAM = (LLAMA[0], {**LLAMA[1], "layers": {**LLAMA[1]["layers"],
                                            "wo": jnp.zeros_like(LLAMA[1]["layers"]["wo"])}})


def bigram_orbits(count: int, distinct: int) -> list[list[int]]:
    """BIGRAM's greedy sequences (21 tokens) from `count` starts whose first `distinct`
    tokens differ."""
    out = run(BIGRAM, jaxgen.GenerationConfig(max_new_tokens=20),
              [[t] for t in range(LLAMA[0].vocab_size)])
    seqs = np.asarray(out.sequences)[:, :21]
    starts = [t for t in range(LLAMA[0].vocab_size)
              if len(set(seqs[t, :distinct].tolist())) == distinct]
    assert len(starts) >= count, starts
    return [seqs[t].tolist() for t in starts[:count]]


def test_a_later_match_is_accepted_where_the_chain_takes_a_wrong_one():
    # Each orbit token s_i first occurs followed by a token z off the orbit, later followed
    # by s_{i+1}: the chain (HF: the earliest match) always drafts z; a width-2 tree holds
    # both continuations.
    prompts, greedy = [], []
    for orbit in bigram_orbits(4, distinct=7):
        z = next(t for t in range(LLAMA[0].vocab_size) if t not in orbit[:7])
        wrong = [t for s in orbit[:6] for t in (s, z)]
        prompts.append(wrong + orbit[:7] + [orbit[0]])  # 20 tokens: RAGGED's bucket
        greedy.append(orbit[1:8])  # plain greedy's 7 tokens after orbit[0]
    chain = run(BIGRAM, TREE_CFG.replace(max_new_tokens=7, assistant_tree_nodes=None),
                prompts)
    tree = run(BIGRAM, TREE_CFG.replace(max_new_tokens=7), prompts)
    chex.assert_trees_all_equal(tree.sequences, chain.sequences)
    for b, prompt in enumerate(prompts):
        assert np.asarray(tree.sequences)[b, len(prompt):len(prompt) + 7].tolist() == greedy[b]
    per_round = {name: np.asarray(o.speculative.accepted).sum()
                 / np.asarray(o.speculative.rounds).sum() for name, o in
                 [("chain", chain), ("tree", tree)]}
    assert per_round["chain"] < 0.2 and per_round["tree"] > 1.5, per_round
