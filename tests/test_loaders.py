"""Checkpoint loaders and the registry: happy paths and clear errors."""
from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from model_fixtures import make_hf_model, save_hf_model, smollm2_gguf_path

from jaxgen.models import DEFAULT_MODEL, LlamaConfig, load
from jaxgen.models.gguf_checkpoint import load_gguf_checkpoint, unpermute_rows
from jaxgen.models.hf_checkpoint import load_hf_checkpoint
from jaxgen.models.safetensors_io import read_safetensors


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf"))
    save_hf_model(make_hf_model("llama", num_key_value_heads=2), folder)
    return folder


def _copy(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def test_hf_loader_reads_config_generation_config_and_dtype(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path / "m")
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6,
                   "suppress_tokens": [4, 5]}, f)
    model, params = load_hf_checkpoint(folder, dtype=jnp.bfloat16)
    cfg = model.config
    assert cfg.eos_token_id == (2, 7) and cfg.bos_token_id == 1
    gen = cfg.generation_defaults_dict
    assert gen["temperature"] == 0.6 and gen["suppress_tokens"] == (4, 5)
    hash(cfg)
    assert params["layers"]["wq"].dtype == jnp.bfloat16
    assert params["layers"]["wk"].shape == (2, 64, 32)


def test_registry_loads_folder_and_gguf_path(hf_folder):
    model, params, tokenizer = load(hf_folder)
    assert model.config.num_layers == 2 and tokenizer is None
    model, params, tokenizer = load(smollm2_gguf_path())
    assert model.config.num_layers == 30 and tokenizer.eos_token_id == 2


def test_default_model_is_cached_and_case_insensitive():
    first = load(DEFAULT_MODEL)
    assert load("SmolLM2-135M-Instruct") is first
    model, params, _ = first
    assert model.config.tie_word_embeddings and "lm_head" not in params
    assert params["embed"].shape == (49152, 576)


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match="no/such/folder"):
        load_hf_checkpoint("/no/such/folder")
    with pytest.raises(FileNotFoundError, match="no/such/folder"):
        load("/no/such/folder")


def test_missing_weights_file(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path / "m")
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(folder)


def test_missing_config(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path / "m")
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("keep", [4, 100, -200])
def test_truncated_safetensors(hf_folder, tmp_path, keep):
    folder = _copy(hf_folder, tmp_path / "m")
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:keep])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_checkpoint(folder)


def test_missing_tensor_is_named(hf_folder, tmp_path):
    from safetensors.numpy import save_file

    folder = _copy(hf_folder, tmp_path / "m")
    path = os.path.join(folder, "model.safetensors")
    tensors = {k: np.array(v) for k, v in read_safetensors(path).items()}
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(folder)


def test_unsupported_architecture(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path / "m")
    config_path = os.path.join(folder, "config.json")
    config = json.load(open(config_path))
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_hf_checkpoint(folder)


def test_truncated_gguf(tmp_path):
    path = str(tmp_path / "cut.gguf")
    with open(smollm2_gguf_path(), "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(3_000_000))
    with pytest.raises(ValueError, match="cut.gguf"):
        load(path)
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        load_gguf_checkpoint(str(tmp_path / "absent.gguf"))


def test_unknown_model_name():
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        load("gpt-17-ultra")
    with pytest.raises(FileNotFoundError):
        load("./not_here/model.gguf")


def test_from_hf_dict_variants():
    base = dict(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    legacy = LlamaConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLM"],
                                       "rope_theta": 5e5, "eos_token_id": [1, 2],
                                       "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_theta == 5e5 and legacy.eos_token_id == (1, 2)
    assert dict(legacy.rope_scaling) == {"factor": 2.0, "rope_type": "linear"}
    mistral = LlamaConfig.from_hf_dict({**base, "architectures": ["MistralForCausalLM"],
                                        "sliding_window": 32})
    assert mistral.sliding_window == 32 and not mistral.attention_bias
    qwen2 = LlamaConfig.from_hf_dict({**base, "architectures": ["Qwen2ForCausalLM"],
                                      "sliding_window": 32, "use_sliding_window": False})
    assert qwen2.attention_bias and not qwen2.attention_out_bias and qwen2.sliding_window is None
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_hf_dict({**base, "architectures": ["LlamaForCausalLM"],
                                  "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_unpermute_inverts_llama_cpp_permutation():
    def permute(w, n_head):  # convert_hf_to_gguf's row permutation for q/k
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]) \
            .swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(unpermute_rows(permute(w, 3), 3), w)
