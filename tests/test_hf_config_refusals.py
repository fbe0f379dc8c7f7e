"""config.json fields that change the math but are not implemented are refused by name in
every family (hidden_act, partial_rotary_factor, quantization_config, a model_type that
contradicts the architecture), as are MTP drafter fields of the wrong type."""
from __future__ import annotations

import json
import os

import jax
import pytest

from jaxgen.models import Llama, LlamaConfig, load
from jaxgen.models.deepseek_v3 import DeepseekV3Config
from jaxgen.models.gemma import GemmaConfig
from jaxgen.models.gemma4_checkpoint import gemma4_config
from jaxgen.models.gemma_checkpoint import load_gemma_config
from jaxgen.models.glm4_moe import Glm4MoeConfig
from jaxgen.models.hf_export import save_hf_checkpoint

SMALL = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5)
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
GLM = dict(model_type="glm4_moe", vocab_size=8, hidden_size=4, intermediate_size=8,
           num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
           first_k_dense_replace=1, n_routed_experts=2, num_experts_per_tok=1,
           moe_intermediate_size=2, num_nextn_predict_layers=0)
GEMMA2 = dict(model_type="gemma2", vocab_size=32, hidden_size=16, intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
              query_pre_attn_scalar=8, sliding_window=4)
GEMMA4 = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=4, global_head_dim=8,
              sliding_window=4, hidden_size_per_layer_input=0,
              layer_types=["sliding_attention", "full_attention"])
DEEPSEEK = dict(model_type="deepseek_v3", vocab_size=32, hidden_size=16, intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8,
                qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, moe_intermediate_size=8,
                n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                first_k_dense_replace=1)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> str:
    model = Llama(LlamaConfig(**SMALL))
    return save_hf_checkpoint(model, model.init_params(jax.random.key(1)),
                              str(tmp_path_factory.mktemp("hf")))


def _with_config(folder: str, tmp_path, **changes) -> str:
    """A copy of `folder` whose config.json has `changes` (the weights linked, not copied)."""
    copy = tmp_path / "m"
    copy.mkdir()
    for name in os.listdir(folder):
        if name != "config.json":
            os.symlink(os.path.join(folder, name), copy / name)
    with open(os.path.join(folder, "config.json")) as f:
        config = {**json.load(f), **changes}
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


# ----------------------------------------------------------------------------- Llama family
@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), r"hidden_act='gelu'; allowed: 'silu'"),
    (dict(hidden_act=5), r"hidden_act=5; allowed: 'silu'"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5; allowed: 1\.0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.25}),
     r"rope_parameters\.partial_rotary_factor=0\.25; allowed: 1\.0"),
    (dict(quantization_config=FP8), r"quantization_config=.*quantized checkpoints .*not "
                                    r"supported; allowed: none"),
    (dict(model_type="qwen2"), r"model_type='qwen2' contradicts architectures="
                               r"\['LlamaForCausalLM'\]; allowed: 'llama' or none"),
    (dict(model_type="nonesuch"), r"model_type='nonesuch' contradicts"),
    (dict(model_type=5), r"model_type=5 contradicts"),
])
def test_llama_fields_that_change_the_math_are_refused(llama_folder, tmp_path, changes,
                                                       message):
    folder = _with_config(llama_folder, tmp_path, **changes)
    path = os.path.join(folder, "config.json")
    with pytest.raises(ValueError, match=rf"^{path}: {message}"):
        load(folder)


@pytest.mark.parametrize("changes", [dict(hidden_act="silu"), dict(partial_rotary_factor=1.0),
                                     dict(quantization_config=None), dict(model_type="llama")])
def test_llama_fields_at_their_neutral_value_load(llama_folder, tmp_path, changes):
    assert load(_with_config(llama_folder, tmp_path, **changes))[0] == Llama(LlamaConfig(**SMALL))


# ----------------------------------------------------------------------------- other families
def test_glm_deepseek_gemma_refuse_a_quantization_config():
    Glm4MoeConfig.from_hf_dict(GLM)  # the configs themselves are fine
    GemmaConfig.from_hf_dict(GEMMA2)
    gemma4_config(GEMMA4)
    DeepseekV3Config.from_hf_dict(DEEPSEEK)
    for build in (lambda c: Glm4MoeConfig.from_hf_dict({**GLM, **c}, where="c.json"),
                  lambda c: GemmaConfig.from_hf_dict({**GEMMA2, **c}, where="c.json"),
                  lambda c: gemma4_config({**GEMMA4, **c}, where="c.json"),
                  lambda c: DeepseekV3Config.from_hf_dict({**DEEPSEEK, **c}, where="c.json")):
        with pytest.raises(ValueError, match=r"^c\.json: quantization_config=.*allowed: none"):
            build({"quantization_config": FP8})


def test_gemma3_refuses_a_top_level_quantization_config(tmp_path):
    text = {k: v for k, v in GEMMA2.items() if k != "model_type"}
    config = {"model_type": "gemma3", "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    load_gemma_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": FP8}))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/config\.json: quantization_config="):
        load_gemma_config(str(tmp_path))


def test_glm_keeps_its_partial_rotary_and_gemma_its_gelu():
    assert Glm4MoeConfig.from_hf_dict({**GLM, "partial_rotary_factor": 0.5}).rotary_dim == 2
    gemma = GemmaConfig.from_hf_dict({**GEMMA2, "hidden_activation": "gelu_pytorch_tanh"})
    assert gemma.hidden_activation == "gelu_pytorch_tanh"


def test_deepseek_config_errors_raised_by_the_config_name_the_file():
    with pytest.raises(ValueError, match=r"^x/config\.json: qk_rope_head_dim=7 is odd"):
        DeepseekV3Config.from_hf_dict({**DEEPSEEK, "qk_rope_head_dim": 7},
                                      where="x/config.json")


# ------------------------------------------------------------------ generation_config.json
SMALL_HF = dict(architectures=["LlamaForCausalLM"], vocab_size=40, hidden_size=16,
                intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=4)
FAMILIES = {  # (config.json changes, generation_config.json) -> the family's config
    "llama": lambda c, g: LlamaConfig.from_hf_dict({**SMALL_HF, **c}, g, where="m/config.json"),
    "glm": lambda c, g: Glm4MoeConfig.from_hf_dict({**GLM, **c}, g, where="m/config.json"),
    "gemma2": lambda c, g: GemmaConfig.from_hf_dict({**GEMMA2, **c}, g, where="m/config.json"),
    "gemma4": lambda c, g: gemma4_config({**GEMMA4, **c}, g, where="m/config.json"),
    "deepseek": lambda c, g: DeepseekV3Config.from_hf_dict({**DEEPSEEK, **c}, g,
                                                           where="m/config.json"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("field, value", [("eos_token_id", 999), ("eos_token_id", [1, -3]),
                                          ("bos_token_id", 1.5), ("pad_token_id", "0")])
def test_special_ids_from_generation_config_are_checked_and_named(family, field, value):
    build = FAMILIES[family]
    config = build({field: 1}, {})  # config.json's own id is fine
    assert getattr(config, field) == ((1,) if field == "eos_token_id" else 1)
    assert getattr(build({}, {field: 3}), field) == ((3,) if field == "eos_token_id" else 3)
    with pytest.raises(ValueError, match=rf"^m/config\.json: generation_config\.json's "
                                         rf"{field}=.*outside the vocabulary; allowed: token ids"):
        build({field: 1}, {field: value})  # generation_config.json's wins, as in HF
    with pytest.raises(ValueError, match=rf"^m/config\.json: {field}=.*outside the vocabulary"):
        build({field: value}, {})


# ----------------------------------------------------------------------------- MTP drafter
@pytest.mark.parametrize("field, value, message", [
    ("q_norm", "false", r"q_norm='false'; allowed: true or false"),
    ("q_norm", 0, r"q_norm=0; allowed: true or false"),
    ("draft_vocab", [True, 2], r"'draft_vocab' must be a list of token ids"),
    ("kv_layers", [True], r"'target\.kv_layers' must be a list of target layer indices"),
])
def test_drafter_config_fields_of_the_wrong_type_are_named(drafter_folder, field, value,
                                                           message):
    path = os.path.join(drafter_folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    (config["target"] if field == "kv_layers" else config)[field] = value
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=rf"^{path}: {message}"):
        load(drafter_folder)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma4", "glm", "deepseek"])
@pytest.mark.parametrize("content", [[1, 2], "text", 3])
def test_a_generation_config_that_is_not_an_object_is_named(family, content, tmp_path):
    from jaxgen.models.deepseek_checkpoint import load_deepseek_v3_config
    from jaxgen.models.gemma4_checkpoint import read_config
    from jaxgen.models.glm4_checkpoint import load_glm4_moe_config
    from jaxgen.models.hf_checkpoint import load_hf_config

    config = {"llama": dict(SMALL, model_type="llama"),
              "gemma2": GEMMA2, "gemma4": {"model_type": "gemma4_text", **GEMMA4},
              "glm": GLM, "deepseek": DEEPSEEK}[family]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    reader = {"llama": load_hf_config, "gemma2": load_gemma_config, "gemma4": read_config,
              "glm": load_glm4_moe_config, "deepseek": load_deepseek_v3_config}[family]
    kind = type(content).__name__
    with pytest.raises(ValueError, match=rf"generation_config\.json holds a {kind}, "
                                         r"expected an object"):
        reader(str(tmp_path))
