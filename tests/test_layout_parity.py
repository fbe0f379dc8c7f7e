"""The portable path (`layout="portable"`: no backend preparation, the program a GPU or TPU
runs) and the CPU backend's layouts (`layout="split"`: weights split per layer, fused, row by
row or through the native kernels, the cache held per layer) give the same tokens as
transformers in every mode: greedy, beam search, assisted (prompt lookup and a draft model),
constrained; sampling draws the same tokens from the same keys in both layouts.

Random models of the shared parity cases, fp32, token for token.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from model_fixtures import SHARED_CASES, hf_generate_rows, make_hf_model, save_hf_model

import jaxgen
from jaxgen.models import TINY_VOCAB, load, tiny_llama, tiny_tokenizer
from jaxgen.runtime import backend

LAYOUTS = ("portable", "split")
CASES = ("llama_tiny", "llama_gqa_untied_llama3")  # a tied and an untied head
PROMPTS = [[5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12, 5, 17, 33], [7, 8], [40, 41, 42, 43, 40, 41]]
NEW = 12


def make_pair(case: str, folder: str):
    arch, overrides = SHARED_CASES[case]
    hf = make_hf_model(arch, seed=11, **overrides)
    model, params, _ = load(save_hf_model(hf, folder))
    return model, params, hf


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    return make_pair(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_pair(CASES[1], str(tmp_path_factory.mktemp("untied")))


def jaxgen_rows(model, params, layout, **settings):
    return jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=NEW, eos_token_id=None,
                               pad_token_id=0, layout=layout, **settings)


def hf_rows(hf, **settings):
    return hf_generate_rows(hf, PROMPTS, 0, max_new_tokens=NEW, eos_token_id=None, top_k=None,
                            top_p=None, temperature=None, **settings)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_and_beam_match_transformers_in_both_layouts(pair, layout):
    model, params, hf = pair
    planned = backend.layout_plan(model, params, len(PROMPTS), layout)
    assert (planned is None) == (layout == "portable")  # "split" lays the weights out
    assert jaxgen_rows(model, params, layout) == hf_rows(hf, do_sample=False)
    assert (jaxgen_rows(model, params, layout, num_beams=3)
            == hf_rows(hf, do_sample=False, num_beams=3))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_assisted_decoding_matches_transformers_greedy_in_both_layouts(untied, layout):
    model, params, hf = untied
    expected = hf_rows(hf, do_sample=False)
    assert jaxgen_rows(model, params, layout, prompt_lookup_num_tokens=3) == expected
    assert jaxgen_rows(model, params, layout, assistant_model=(model, params),
                       num_assistant_tokens=3) == expected


def test_sampling_draws_the_same_tokens_in_both_layouts(untied):
    model, params, _ = untied
    key = jax.random.key(4)
    portable, split = (jaxgen_rows(model, params, layout, do_sample=True, temperature=0.8,
                                   top_k=20, key=key) for layout in LAYOUTS)
    assert portable == split
    assert any(len(row) > len(prompt) for row, prompt in zip(portable, PROMPTS))


def test_constrained_rows_are_the_same_in_both_layouts():
    tok = tiny_tokenizer()
    model, params = tiny_llama(seed=3, vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2)
    rows = {layout: jaxgen.generate_ids(model, params, [[72, 101], [49, 50, 51]], tokenizer=tok,
                                        regex=r"[0-9]{4}-[0-9]{2}", max_new_tokens=10,
                                        eos_token_id=256, pad_token_id=0, layout=layout)
            for layout in LAYOUTS}
    assert rows["portable"] == rows["split"]
    assert all(len(row) > 3 for row in rows["portable"])


def test_a_bad_layout_names_the_argument_and_the_choices_before_compiling():
    model, params = tiny_llama()
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=r"layout='gpu'.*'auto', 'portable', 'split'"):
        jaxgen.generate_ids(model, params, [[1, 2]], max_new_tokens=2, layout="gpu")
    assert jaxgen.trace_count() == before


def test_the_portable_path_never_imports_a_backend(tmp_path):
    """What a GPU or TPU runs: no module of jaxgen.backends is loaded, even on a CPU."""
    script = tmp_path / "portable.py"
    script.write_text(
        "import json, sys\n"
        "import jaxgen\n"
        "from jaxgen.models import tiny_llama\n"
        "model, params = tiny_llama()\n"
        "rows = jaxgen.generate_ids(model, params, [[1, 2, 3]], max_new_tokens=3,"
        " layout='portable')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('jaxgen.backends'))))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXGEN_")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
