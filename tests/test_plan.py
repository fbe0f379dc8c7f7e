"""The plan, the contracts and the shared step pieces: one way through `generate`.

Covers: make_plan's loop / driver / donation choices and its cross-field errors; a drafter
kind added by one module and one DRAFTERS entry (reading the target's params, cache and
hidden state through the Drafter contract); prefill_chunk_size and max_cache_len; and the
host-side checks that turn bad input into clear errors before anything compiles (consumed
state, key, cache dtype, per-row values, params of another model, non-finite logits).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, ClassVar

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgen
from jaxgen import stopping
from jaxgen.api import plan as plan_module
from jaxgen.api.plan import CustomLoop, make_plan
from jaxgen.core.contracts import Drafter, DraftRequest, Model, Proposal
from jaxgen.core.output import outputs_to_lists
from jaxgen.core.step import write_if_live
from jaxgen.loops.beam import BeamLoop
from jaxgen.loops.decode import DecodeLoop
from jaxgen.models import Llama, LlamaConfig
from jaxgen.speculative.loop import SpeculativeLoop

MODEL = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=()))
PARAMS = MODEL.init_params(jax.random.key(3))
PROMPTS = [[5, 9, 11, 5, 9], [7, 3, 22, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52,
                              53, 54, 55]]


def greedy(cfg=None, prompts=PROMPTS, **kw):
    cfg = cfg or jaxgen.GenerationConfig(max_new_tokens=12)
    return jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, prompts, cfg), cfg, **kw)


# ------------------------------------------------------------------------- the plan
def test_the_model_honours_the_model_contract():
    assert isinstance(MODEL, Model)


@pytest.mark.parametrize("fields, hooks, loop, driver, donate", [
    (dict(), dict(), DecodeLoop, "single", True),
    (dict(do_sample=True), dict(), DecodeLoop, "single", True),
    (dict(num_beams=2), dict(), BeamLoop, "single", False),
    (dict(prompt_lookup_num_tokens=3), dict(), SpeculativeLoop, "single", True),
    (dict(), dict(assistant_model=(MODEL, PARAMS)), SpeculativeLoop, "single", True),
    (dict(max_time=5.0), dict(), DecodeLoop, "chunked", True),
    (dict(), dict(stop_event=threading.Event()), DecodeLoop, "chunked", True),
    (dict(prompt_lookup_num_tokens=3), dict(stop_event=threading.Event()), SpeculativeLoop,
     "chunked", True),
    (dict(cache_implementation="dynamic"), dict(), DecodeLoop, "growing", True),
    (dict(), dict(custom_generate=lambda p, s, c: s), CustomLoop, "single", True),
])
def test_make_plan_picks_loop_driver_and_donation(fields, hooks, loop, driver, donate):
    cfg = jaxgen.GenerationConfig(max_new_tokens=4, **fields)
    plan = make_plan(jaxgen.init_state(MODEL, PROMPTS, cfg), cfg, **hooks)
    assert type(plan.loop) is loop and plan.driver == driver and plan.donate == donate
    hash(plan.loop)  # static for the jit


@pytest.mark.parametrize("fields, hooks, needle", [
    (dict(num_beams=2), dict(stop_event=threading.Event()), "beam search"),
    (dict(num_beams=2, prompt_lookup_num_tokens=3), dict(), "num_beams"),
    (dict(prompt_lookup_num_tokens=3), dict(assistant_model=(MODEL, PARAMS)), "only one way"),
    (dict(cache_implementation="dynamic", prompt_lookup_num_tokens=3), dict(), "dynamic"),
    (dict(max_time=1.0), dict(custom_generate=lambda p, s, c: s), "custom_generate"),
    (dict(), dict(num_assistant_tokens=3), "num_assistant_tokens"),
    (dict(prompt_lookup_num_tokens=3), dict(num_assistant_tokens=0), "num_assistant_tokens"),
    (dict(), dict(chunk_size=0, stop_event=threading.Event()), "chunk_size"),
])
def test_make_plan_refuses_combinations_before_compiling(fields, hooks, needle):
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=needle):  # from the config or from the plan
        cfg = jaxgen.GenerationConfig(max_new_tokens=4, **fields)
        jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, cfg), cfg, **hooks)
    assert jaxgen.trace_count() == before


def test_plan_under_vmap_donates_nothing():
    cfg = jaxgen.GenerationConfig(max_new_tokens=4, do_sample=True)
    state = jaxgen.init_state(MODEL, PROMPTS, cfg)
    seen = []

    def run(temperature):
        c = cfg.replace(temperature=temperature)
        seen.append(make_plan(state, c))
        return jaxgen.generate(PARAMS, state, c).sequences

    out = jax.vmap(run)(jnp.array([0.5, 1.5]))
    assert out.shape == (2, 2, state.visible_len) and seen[0].donate is False


# ------------------------------------------------------------------------- a new drafter kind
@dataclasses.dataclass(frozen=True)
class SelfDrafter:
    """Drafts with the target itself, in the target's own cache (what a shared-cache early
    exit at E = num_layers does), and records the target hidden state it was handed."""

    model: Any
    num_tokens: int
    scheduled: ClassVar[bool] = False
    reads: ClassVar[frozenset] = frozenset({"params", "cache", "hidden"})

    @classmethod
    def from_request(cls, cfg, target_model, assistant):
        if assistant != "self":
            return None
        return cls(model=target_model, num_tokens=3), None

    def init(self, draft_params, state, target_params=None):
        return jnp.zeros((state.batch,), jnp.int32)  # last head(hidden) argmax per row

    def rollback(self, draft_state, length):
        return draft_state

    def propose(self, draft_params, draft_state, request: DraftRequest):
        state, params = request.state, request.target_params
        batch, width = state.tokens.shape
        # what the handed hidden state predicted: must be each row's newest token (greedy)
        predicted = jnp.argmax(self.model.head(params, request.hidden[:, None])[:, 0], -1)
        cache = state.cache
        tokens, position = state.tokens, state.length - 1
        last = jnp.take_along_axis(tokens, position[:, None], axis=1)  # [B, 1]
        drafts = []
        for i in range(self.num_tokens):
            out = self.model(params, last, (position + i)[:, None], cache)
            cache = out.cache
            last = jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32)[:, None]  # [B, 1]
            drafts.append(last[:, 0])
        drafts = jnp.stack(drafts, axis=1)  # [B, K]
        work = tokens
        for i in range(self.num_tokens):
            work = write_if_live(work, state.length + i, drafts[:, i], request.k_want > i)
        proposal = Proposal(drafts=drafts, q_scores=None, k_row=request.k_want, tokens=work,
                            forwards=jnp.int32(self.num_tokens))
        # The target's own cache, written at the draft positions; the verify forward
        # rewrites the same entries, and its length is unchanged.
        return proposal, predicted.astype(jnp.int32), cache.with_length(state.cache.length)


def test_a_drafter_kind_is_one_module_and_one_plan_entry(monkeypatch):
    assert isinstance(SelfDrafter(MODEL, 3), Drafter)
    # The new kind takes the place of the draft-model entry (both read `assistant_model`).
    kinds = tuple(k for k in plan_module.DRAFTERS if k.__name__ != "DraftModelDrafter")
    monkeypatch.setattr(plan_module, "DRAFTERS", kinds + (SelfDrafter,))
    cfg = jaxgen.GenerationConfig(max_new_tokens=12)
    out = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, cfg), cfg,
                          assistant_model="self")
    plain = greedy(cfg)
    chex.assert_trees_all_equal(out.sequences, plain.sequences)
    stats = out.speculative
    # the target drafting for itself: (nearly) every draft is accepted
    assert float(np.sum(stats.accepted)) >= 0.9 * float(np.sum(stats.drafted)) > 0
    # the hidden state handed to the drafter predicted each row's newest token
    newest = np.take_along_axis(np.asarray(out.sequences),
                                np.asarray(out.lengths)[:, None] - 1, axis=1)[:, 0]
    np.testing.assert_array_equal(np.asarray(out.state.spec.draft_state), newest)


# ------------------------------------------------------------------------- config fields
@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("mode, hooks", [
    (dict(), dict()), (dict(num_beams=2), dict()), (dict(prompt_lookup_num_tokens=3), dict()),
    pytest.param(dict(), dict(assistant_model=(MODEL, PARAMS)), marks=pytest.mark.slow),
    (dict(cache_implementation="quantized", cache_config={"residual_length": 4}), dict()),
    (dict(cache_implementation="sliding_window", cache_config={"sliding_window": 6}), dict()),
])
def test_prefill_chunk_size_gives_the_same_tokens(chunk, mode, hooks):
    base = jaxgen.GenerationConfig(max_new_tokens=8, **mode)
    whole = greedy(base, **hooks)
    chunked = greedy(base.replace(prefill_chunk_size=chunk), **hooks)
    chex.assert_trees_all_equal(whole.sequences, chunked.sequences)
    chex.assert_trees_all_close(whole.token_logprobs, chunked.token_logprobs, atol=1e-4)


def test_max_cache_len_sets_the_buffer_and_refuses_a_short_one():
    cfg = jaxgen.GenerationConfig(max_new_tokens=8, max_cache_len=64)
    state = jaxgen.init_state(MODEL, PROMPTS, cfg)
    chex.assert_shape(state.tokens, (2, 64))
    assert state.cache.max_len == 64
    chex.assert_trees_all_equal(greedy(cfg).sequences[:, :28],
                                greedy(cfg.replace(max_cache_len=None)).sequences[:, :28])
    with pytest.raises(ValueError, match="max_cache_len"):
        jaxgen.init_state(MODEL, PROMPTS, cfg.replace(max_cache_len=20))


# ------------------------------------------------------------------------- bad input
def test_a_consumed_state_is_a_clear_error():
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    state = jaxgen.init_state(MODEL, PROMPTS, cfg)
    jaxgen.generate(PARAMS, state, cfg)
    with pytest.raises(ValueError, match="consumed by an earlier generate call"):
        jaxgen.generate(PARAMS, state, cfg)


@pytest.mark.parametrize("key, needle", [(0, r"jax.random.key\(0\)"), ("seed", "PRNG key"),
                                         (np.zeros((3,), np.uint32), "uint32"),
                                         (jax.random.split(jax.random.key(0), 3), "one per row")])
def test_bad_keys_say_what_is_expected(key, needle):
    with pytest.raises(ValueError, match=needle):
        jaxgen.init_state(MODEL, PROMPTS, jaxgen.GenerationConfig(max_new_tokens=4), key)


def test_raw_and_typed_keys_agree():
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, do_sample=True)
    typed = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, cfg, jax.random.key(7)),
                            cfg)
    raw = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, cfg, jax.random.PRNGKey(7)),
                          cfg)
    chex.assert_trees_all_equal(typed.sequences, raw.sequences)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, "uint8", "not-a-dtype"])
def test_integer_cache_dtypes_are_refused(dtype):
    with pytest.raises(ValueError, match="cache_dtype"):
        jaxgen.init_state(MODEL, PROMPTS, jaxgen.GenerationConfig(max_new_tokens=4),
                          cache_dtype=dtype)


def test_per_row_sampling_values_accept_lists_and_check_the_batch():
    base = jaxgen.GenerationConfig(max_new_tokens=6, do_sample=True)
    as_list = greedy(base.replace(temperature=[0.5, 1.5]))
    as_array = greedy(base.replace(temperature=np.array([0.5, 1.5], np.float32)))
    chex.assert_trees_all_equal(as_list.sequences, as_array.sequences)
    cfg = base.replace(temperature=[0.5, 0.7, 0.9])
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match="temperature"):
        jaxgen.init_state(MODEL, PROMPTS, cfg)
    state = jaxgen.init_state(MODEL, PROMPTS, base)
    with pytest.raises(ValueError, match="temperature"):
        jaxgen.generate(PARAMS, state, cfg)
    assert jaxgen.trace_count() == before


def test_params_of_another_model_fail_before_compiling():
    other = Llama(dataclasses.replace(MODEL.config, num_layers=3)).init_params(jax.random.key(0))
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match="expected"):
        jaxgen.generate(other, jaxgen.init_state(MODEL, PROMPTS, cfg), cfg)
    with pytest.raises(ValueError, match="expected"):
        jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, cfg), cfg,
                        assistant_model=(MODEL, other))
    assert jaxgen.trace_count() == before


def _poisoned(token: int):
    """Params whose embedding of `token` is NaN: rows that read it get NaN logits."""
    embed = PARAMS["embed"].at[token].set(jnp.nan)
    return {**PARAMS, "embed": embed}


@pytest.mark.parametrize("mode", [dict(), dict(do_sample=True),
                                  dict(prompt_lookup_num_tokens=3), dict(num_beams=2)])
def test_non_finite_logits_stop_the_row_with_their_own_reason(mode):
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, **mode)
    params = _poisoned(22)  # only the second prompt holds token 22
    out = jaxgen.generate(params, jaxgen.init_state(MODEL, PROMPTS, cfg), cfg)
    reasons = np.asarray(out.stop_reason).reshape(2, -1)
    assert (reasons[1] == stopping.INVALID_LOGITS).all()
    assert (reasons[0] != stopping.INVALID_LOGITS).all()
    assert stopping.STOP_REASONS[stopping.INVALID_LOGITS] == "invalid_logits"


def test_step_pieces_share_one_stop_priority():
    from jaxgen.core.step import StopFlags, reason_of
    true, false = jnp.array([True]), jnp.array([False])
    flags = StopFlags(eos=true, full=true, string=true, custom=true, invalid=false)
    assert int(reason_of(flags)[0]) == stopping.EOS
    assert int(reason_of(dataclasses.replace(flags, invalid=true))[0]) == stopping.INVALID_LOGITS
    assert int(reason_of(dataclasses.replace(flags, eos=false))[0]) == stopping.STOP_STRING
    assert int(reason_of(StopFlags(eos=false, full=true, custom=true))[0]) == stopping.CUSTOM
    assert int(reason_of(StopFlags(eos=false, full=true))[0]) == stopping.MAX_LENGTH


# ------------------------------------------------------------------------- return sequences
def test_sampling_with_num_return_sequences_expands_each_prompt():
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, do_sample=True, temperature=[0.7, 1.5],
                                  num_return_sequences=3)
    key = jax.random.key(4)
    out = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, cfg, key), cfg)
    chex.assert_shape(out.sequences, (6, None))
    # the same as repeating every prompt three times by hand, with the same key
    by_hand = [row for row in PROMPTS for _ in range(3)]
    single = cfg.replace(num_return_sequences=1, temperature=[0.7] * 3 + [1.5] * 3)
    manual = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, by_hand, single, key), single)
    chex.assert_trees_all_equal(out.sequences, manual.sequences)
    rows = outputs_to_lists(out)
    assert all(row[:len(PROMPTS[i // 3])] == PROMPTS[i // 3] for i, row in enumerate(rows))
    assert len({tuple(row) for row in rows[:3]}) > 1  # the copies sample on their own


def test_per_prompt_keys_give_each_copy_its_own_key():
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, do_sample=True, num_return_sequences=2)
    keys = jax.random.split(jax.random.key(8), 2)
    out = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, cfg, keys), cfg)
    alone = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS[1:], cfg, keys[1:]), cfg)
    n = len(PROMPTS[1]) + 6
    np.testing.assert_array_equal(np.asarray(out.sequences)[2:, :n],
                                  np.asarray(alone.sequences)[:, :n])


def test_a_buffer_larger_than_memory_is_refused_before_allocating():
    """Refused from shapes alone: the host token buffer is never allocated (numpy reports
    its allocations to tracemalloc)."""
    import tracemalloc

    model = Llama(dataclasses.replace(MODEL.config, max_position_embeddings=2**31 - 1))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="GiB"):
            jaxgen.init_state(model, PROMPTS, jaxgen.GenerationConfig(max_new_tokens=2**30))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**26, f"{peak / 2**20:.0f} MiB allocated before the refusal"
