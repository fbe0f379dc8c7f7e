"""Every decoding mode on the seeds' own families: Gemma 2, Gemma 4 (text), GLM-4.5 (glm4_moe)
and DeepSeek-V3, fp32 on CPU.

Each family's tiny random model comes from its own test file's builder (built by transformers,
saved with save_pretrained, loaded with jaxgen.models.load; the vocabulary widened to the tiny
tokenizer's, TINY_VOCAB, so regex constraints run), once per family (a module fixture). The
checks:
  a. a regex constraint: every row's new text fully matches the pattern and ends with EOS;
  b. classifier-free guidance (batch of one; a ragged batch with negative prompts) gives
     transformers' guided tokens and scores on the same weights;
  c. prompt lookup and a draft model (a tiny jaxgen Llama of the same vocabulary) give plain
     greedy's tokens on a ragged batch, having drafted;
  d. the int8 (quantized) KV cache stays close to the static cache's logits, the other cache
     kinds a family supports give the static cache's greedy tokens, the ones it does not are
     refused naming cache_implementation;
  e. layout "portable", "auto" and "split" give the same greedy tokens (the CPU backend lays
     out only jaxgen's Llama: other families run the portable program under every layout);
  f. seeded sampling is reproducible and its first token follows transformers' softmax
     (chi-square over 1000 rows).
The default run holds the checks that compile nothing (d's refusals, e's seam); the compiled
ones are marked slow (minutes per family on two cores).
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_sampling import chi_square
from test_deepseek_v3 import CASES as DEEPSEEK_CASES
from test_deepseek_v3 import TINY_DS, build_folder
from test_gemma import COMMON as GEMMA_COMMON
from test_gemma import FAMILIES as GEMMA_FAMILIES
from test_gemma import make_hf_gemma
from test_gemma4 import TEXT as GEMMA4_TEXT
from test_gemma4 import make_hf_gemma4
from test_glm4_moe import CASES as GLM_CASES
from test_glm4_moe import COMMON as GLM_COMMON
from test_glm4_moe import glm_folder, hf_model
from test_guidance import NEGATIVES, PROMPTS, hf_guided, jax_guided, likely_eos

import jaxgen
from jaxgen.models import (
    DeepseekV3,
    DeepseekV3Config,
    Gemma,
    Glm4Moe,
    Glm4MoeConfig,
    load,
    tiny_llama,
    tiny_tokenizer,
)
from jaxgen.models.gemma import GemmaConfig
from jaxgen.models.gemma4 import Gemma4
from jaxgen.models.gemma4_checkpoint import gemma4_config
from jaxgen.models.tiny import TINY_VOCAB
from jaxgen.runtime import backend

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILY_NAMES = ("gemma2", "gemma4", "glm4_moe", "deepseek_v3")
# ragged, and rows 0 and 2 end in an n-gram seen before in them: prompt lookup drafts
RAGGED = [[5, 17, 33, 2, 60, 5, 17, 33, 2, 60, 5, 17], [7, 8], [40, 41, 42, 40, 41, 42], [9]]
PAD, NEW = 0, 8
SLOW = pytest.mark.slow

# What each family's cache supports: the kinds that must give the static cache's tokens (with
# their cache_config), whether it has the int8 kind, and the refused kinds -> the error's text.
DENSE_KINDS = {
    "gemma2": {"dynamic": {"initial_length": 16}, "offloaded": {"offload_on_cpu": True}},
    "gemma4": {"dynamic": {"initial_length": 16}},
    "glm4_moe": {"dynamic": {"initial_length": 16}, "offloaded": {"offload_on_cpu": True}},
    "deepseek_v3": {"dynamic": {"initial_length": 16}},
}
HAS_INT8_CACHE = {"gemma2": True, "gemma4": False, "glm4_moe": True, "deepseek_v3": False}
_GEMMA4_NO = r"cache_implementation='{kind}' is not supported by Gemma 4 in jaxgen; " \
             r"allowed: static, dynamic"
_LATENT_NO = r"cache_implementation='{kind}' is not supported by DeepSeek-V3's latent cache" \
             r".*allowed: static, dynamic"
REFUSED_KINDS = {
    "gemma2": {"sliding_window": r"cache_implementation='sliding_window' keeps one window for "
                                 r"every layer, but this model mixes .*\(layer_types\); "
                                 r"allowed: static, dynamic, quantized, offloaded"},
    "gemma4": {kind: _GEMMA4_NO.format(kind=kind)
               for kind in ("quantized", "sliding_window", "offloaded")},
    "glm4_moe": {"sliding_window": r"cache_implementation='sliding_window' needs a window: the "
                                   r"model has no sliding_window in its config"},
    "deepseek_v3": {kind: _LATENT_NO.format(kind=kind)
                    for kind in ("quantized", "sliding_window", "offloaded")},
}


# ------------------------------------------------------------------------- the models
def config_only_model(family: str):
    """The family's jaxgen model from its test file's config alone (no weights built)."""
    if family == "gemma2":
        hf = transformers.Gemma2Config(**{**GEMMA_COMMON, **GEMMA_FAMILIES["gemma2"]})
        return Gemma(GemmaConfig.from_hf_dict(hf.to_dict()))
    if family == "gemma4":
        return Gemma4(gemma4_config(transformers.Gemma4TextConfig(**GEMMA4_TEXT).to_dict()))
    if family == "glm4_moe":
        hf = transformers.Glm4MoeConfig(**GLM_COMMON, num_hidden_layers=2)
        return Glm4Moe(Glm4MoeConfig.from_hf_dict(hf.to_dict()))
    hf = transformers.DeepseekV3Config(**TINY_DS, num_hidden_layers=2)
    return DeepseekV3(DeepseekV3Config.from_hf_dict(hf.to_dict()))


class Family:
    """One family's transformers model and jaxgen (model, params), built once; its plain greedy
    rows computed on first use."""

    def __init__(self, name: str, folder: str):
        self.name = name
        wide = {"vocab_size": TINY_VOCAB}
        if name == "gemma2":
            self.hf = make_hf_gemma("gemma2")  # TINY_VOCAB already
            self.hf.save_pretrained(folder)
        elif name == "gemma4":
            self.hf = make_hf_gemma4(seed=3, vocab_size_per_layer_input=TINY_VOCAB, **wide)
            self.hf.save_pretrained(folder)
        elif name == "glm4_moe":
            glm_folder(folder, embed_scale=20.0, **GLM_CASES["main"], **wide)
            self.hf = hf_model(folder)
        else:
            self.hf = build_folder(folder, seed=3, **DEEPSEEK_CASES["q_lora_interleaved"], **wide)
        self.model, self.params, _ = load(folder)
        assert self.model.vocab_size == TINY_VOCAB

    def run(self, prompts=RAGGED, *, key=None, layout="auto", assistant_model=None, **cfg):
        """jaxgen.generate on `prompts` (greedy, no EOS, NEW tokens unless cfg says else)."""
        cfg = jaxgen.GenerationConfig(**{"max_new_tokens": NEW, "pad_token_id": PAD,
                                         "eos_token_id": None, **cfg})
        state = jaxgen.init_state(self.model, prompts, cfg, key)
        return jaxgen.generate(self.params, state, cfg, layout=layout,
                               assistant_model=assistant_model)

    @functools.cached_property
    def greedy(self) -> list[list[int]]:
        return rows_of(self.run())


def rows_of(out) -> list[list[int]]:
    """Prompt + new ids per row, padding removed."""
    seqs, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    return [seqs[b, :lengths[b]].tolist() for b in range(len(lengths))]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, str(tmp_path_factory.mktemp(request.param)))


# ------------------------------------------------------------------------- default: no compile
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_unsupported_cache_kinds_are_refused_naming_the_field(name):
    """generate_ids refuses each cache kind the family's cache cannot be, before anything runs,
    with cache_implementation and the allowed kinds in the message."""
    model = config_only_model(name)
    for kind, message in REFUSED_KINDS[name].items():
        with pytest.raises(ValueError, match=message):
            jaxgen.generate_ids(model, None, RAGGED, max_new_tokens=2, pad_token_id=PAD,
                                cache_implementation=kind)
    for kind in DENSE_KINDS[name]:  # and builds the kinds it supports
        model.init_cache(2, 8, kind=kind)
    if HAS_INT8_CACHE[name]:
        model.init_cache(2, 8, kind="quantized")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_backend_seam_leaves_other_families_portable(name):
    """Under "auto" and "split" the CPU backend lays out no params of these families (only
    jaxgen's Llama): no plan, the params and cache handed back as they are, so every layout
    runs the portable program (the tokens: test_layouts_give_the_same_tokens)."""
    model = config_only_model(name)
    params = jax.eval_shape(model.init_params, jax.random.key(0))  # shapes only
    cfg = jaxgen.GenerationConfig(max_new_tokens=2, pad_token_id=PAD)
    state = jaxgen.init_state(model, RAGGED, cfg)
    for layout in ("auto", "split"):
        assert backend.layout_plan(model, params, len(RAGGED), layout) is None
        for rows in (1, len(RAGGED), None):
            prepared, same = backend.prepare(model, params, state, rows, True, layout)
            assert prepared is params and same.cache is state.cache, (layout, rows)
        assert backend.finish(state, layout).cache is state.cache


# ------------------------------------------------------------------------- a. constraints
@SLOW
def test_regex_rows_match_the_pattern_and_end_with_eos(family):
    tok = tiny_tokenizer()
    pattern = "(ab|cd){2,4}x"
    prompts = [tok.encode("hello"), tok.encode("a"), tok.encode("the stop")]
    rows = jaxgen.generate_ids(family.model, family.params, prompts, tokenizer=tok,
                               regex=pattern, max_new_tokens=24, eos_token_id=tok.eos_token_id,
                               pad_token_id=PAD)
    for prompt, row in zip(prompts, rows):
        new = row[len(prompt):]
        assert new[-1] == tok.eos_token_id, tok.decode(new)
        assert re.fullmatch(pattern, tok.decode(new[:-1])), tok.decode(new)


# ------------------------------------------------------------------------- b. guidance
@SLOW
@pytest.mark.parametrize("case", ["single", "ragged_negative"])
def test_guidance_matches_transformers(family, case):
    """guidance_scale (and negative_prompt_ids on a ragged batch): transformers' tokens and
    scores (test_guidance's comparison, on this family's weights)."""
    prompts = PROMPTS[:1] if case == "single" else PROMPTS
    negatives = NEGATIVES if case == "ragged_negative" else None
    scale = 1.5 if case == "single" else 3.0
    eos = likely_eos(family.hf, prompts)
    expected, hf_scores = hf_guided(family.hf, prompts, negatives, scale, eos)
    got, scores = jax_guided(family.model, family.params, prompts, negatives, scale, eos)
    assert got == expected
    plain = jaxgen.generate_ids(family.model, family.params, prompts, max_new_tokens=NEW,
                                pad_token_id=PAD, eos_token_id=None)
    assert any(r[len(p):len(p) + len(g)] != g for r, p, g in zip(plain, prompts, got))
    for b, row in enumerate(got):  # each row's live steps
        np.testing.assert_allclose(scores[b, :len(row)], hf_scores[b, :len(row)], rtol=1e-4,
                                   atol=1e-4)


# ------------------------------------------------------------------------- c. assisted
@SLOW
@pytest.mark.parametrize("mode", ["prompt_lookup", "draft_model"])
def test_assisted_greedy_equals_plain_greedy(family, mode):
    """assistant_fallback off: every row drafts whenever it can (the cost model would let a
    batch whose rows 1 and 3 find no n-gram take plain steps only)."""
    if mode == "prompt_lookup":
        out = family.run(prompt_lookup_num_tokens=3, assistant_fallback=False)
    else:
        draft = tiny_llama(seed=1, vocab_size=TINY_VOCAB, num_layers=2)
        out = family.run(assistant_model=draft, num_assistant_tokens=3,
                         assistant_fallback=False)
    assert rows_of(out) == family.greedy
    assert int(np.sum(out.speculative.drafted)) > 0  # the drafter ran


# ------------------------------------------------------------------------- d. cache kinds
@SLOW
def test_int8_cache_logits_stay_close_to_the_static_caches(family):
    """Prefill and one cached decode step over the quantized cache: logits within 5% of the
    largest static-cache logit, and not equal to them (the int8 cache is in use)."""
    if not HAS_INT8_CACHE[family.name]:
        with pytest.raises(ValueError, match="cache_implementation='quantized'"):
            family.model.init_cache(1, 16, kind="quantized")
        return
    model, params = family.model, family.params
    prompt = RAGGED[0]
    tokens, positions = jnp.asarray([prompt], jnp.int32), jnp.arange(len(prompt))[None]
    step, at = jnp.asarray([[7]], jnp.int32), jnp.asarray([[len(prompt)]])
    logits = {}
    for kind in ("static", "quantized"):
        out = model(params, tokens, positions, model.init_cache(1, 16, kind=kind))
        decoded = model(params, step, at, out.cache)
        logits[kind] = (out.logits[0, -1], decoded.logits[0, -1])  # [V] each
    for dense, quant in zip(logits["static"], logits["quantized"]):
        err = float(jnp.max(jnp.abs(quant - dense)))
        assert 0 < err < 0.05 * float(jnp.max(jnp.abs(dense)))


@SLOW
def test_other_cache_kinds_give_the_static_tokens(family):
    for kind, options in DENSE_KINDS[family.name].items():
        out = family.run(cache_implementation=kind, cache_config=options)
        assert rows_of(out) == family.greedy, kind


# ------------------------------------------------------------------------- e. layouts
@SLOW
def test_layouts_give_the_same_tokens(family):
    """family.greedy runs layout="auto"; "portable" and "split" give its tokens."""
    for layout in ("portable", "split"):
        assert rows_of(family.run(layout=layout)) == family.greedy, layout


# ------------------------------------------------------------------------- f. sampling
@SLOW
def test_seeded_sampling_is_reproducible_and_follows_transformers_softmax(family):
    prompt, rows, temperature = RAGGED[2], 1000, 0.7
    sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": None,
              "max_new_tokens": 1}
    first = rows_of(family.run([prompt] * rows, key=jax.random.key(5), **sample))
    again = rows_of(family.run([prompt] * rows, key=jax.random.key(5), **sample))
    other = rows_of(family.run([prompt] * rows, key=jax.random.key(6), **sample))
    assert first == again and first != other
    with torch.no_grad():
        logits = family.hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    tokens = [row[len(prompt)] for row in first]
    assert chi_square(np.bincount(tokens, minlength=TINY_VOCAB), probs) > 1e-3
    assert len(set(tokens)) > 3  # really sampled
