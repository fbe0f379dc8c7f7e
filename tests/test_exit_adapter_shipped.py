"""The embedded SmolLM2 carries its trained exit adapter: load() attaches it and says so
(config.exit_adapter_layers), assistant_early_exit=15 drafts through it and stays lossless,
and another exit layer exits plainly."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxgen
from jaxgen import generate, init_state
from jaxgen.api.generate import default_config, outputs_to_lists
from jaxgen.models import LlamaConfig


@pytest.fixture(scope="module")
def smollm():
    return jaxgen.models.load("smollm2-135m-instruct")


def test_load_attaches_the_shipped_adapter(smollm):
    model, params, _ = smollm
    assert model.config.exit_adapter_layers == (15,)
    assert sorted(params["exit_adapters"]) == ["15"]
    model.check_params(params)


def test_the_adapter_serves_layer_15_only(smollm):
    model, params, _ = smollm
    hidden = jax.random.normal(jax.random.key(0), (1, 2, model.config.hidden_size))  # [1,2,D]
    plain = np.asarray(model.head(params, hidden))  # [1, 2, V]
    np.testing.assert_array_equal(np.asarray(model.exit_head(params, hidden, 8)), plain)
    assert not np.allclose(np.asarray(model.exit_head(params, hidden, 15)), plain, atol=1e-3)


@pytest.mark.slow
def test_early_exit_with_the_adapter_is_lossless(smollm):
    model, params, tokenizer = smollm
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three colors.")]
    cfg = default_config(model, None, max_new_tokens=16)
    ref = outputs_to_lists(generate(params, init_state(model, prompts, cfg), cfg))
    exit_cfg = cfg.replace(assistant_early_exit=15, num_assistant_tokens=3)
    out = generate(params, init_state(model, prompts, exit_cfg), exit_cfg)
    assert outputs_to_lists(out) == ref
    assert 0 < int(np.sum(out.speculative.accepted))


@pytest.mark.parametrize("layers", [(0,), (30,), (True,), ("15",)])
def test_bad_exit_adapter_layers_are_refused(layers):
    with pytest.raises(ValueError, match="exit_adapter_layers"):
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=30,
                    num_heads=2, num_kv_heads=1, head_dim=8, exit_adapter_layers=layers)
