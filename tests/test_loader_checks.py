"""Loader strictness: unused tensors, non-finite weights, malformed safetensors files, and
`Llama.check_params` on both params layouts."""
from __future__ import annotations

import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxgen.models import Llama, LlamaConfig, load, unstack_layers
from jaxgen.models.gguf_checkpoint import load_gguf_checkpoint
from jaxgen.models.hf_checkpoint import load_hf_checkpoint
from jaxgen.models.hf_export import save_hf_checkpoint, to_hf_arrays
from jaxgen.models.safetensors_io import read_safetensors, write_safetensors

SMALL = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5)


def small_model(**overrides) -> Llama:
    return Llama(LlamaConfig(**{**SMALL, **overrides}))


def assert_same_params(actual, expected):
    flat_a, tree_a = jax.tree_util.tree_flatten(actual)
    flat_e, tree_e = jax.tree_util.tree_flatten(expected)
    assert tree_a == tree_e
    for a, e in zip(flat_a, flat_e):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, params, folder) of a 2-layer untied model saved as a HF folder."""
    model = small_model()
    params = model.init_params(jax.random.key(1))
    folder = save_hf_checkpoint(model, params, str(tmp_path_factory.mktemp("hf")))
    return model, params, folder


def _edit_tensors(folder, change):
    """Rewrites model.safetensors after `change(tensors)` edits the name -> array dict."""
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    change(tensors)
    write_safetensors(path, tensors, metadata={"format": "pt"})


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def _copy(saved, tmp_path) -> str:
    return shutil.copytree(saved[2], str(tmp_path / "m"))


# ----------------------------------------------------------------------------- safetensors
def test_round_trip_fp32_and_bf16(saved, tmp_path):
    model, params, folder = saved
    loaded_model, loaded = load_hf_checkpoint(folder)
    assert loaded_model == model
    assert_same_params(loaded, params)
    bf16 = save_hf_checkpoint(model, params, str(tmp_path / "bf16"), dtype=ml_dtypes.bfloat16)
    assert read_safetensors(os.path.join(bf16, "model.safetensors"))[
        "model.norm.weight"].dtype == ml_dtypes.bfloat16
    _, loaded = load_hf_checkpoint(bf16, dtype=jnp.bfloat16)
    assert loaded["layers"]["wq"].dtype == jnp.bfloat16
    expected = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
    assert_same_params(loaded, expected)


@pytest.mark.parametrize("header", [b"{not json}", b"[]", b'{"x": {"dtype": "F32"}}'])
def test_bad_header_names_the_file(saved, tmp_path, header):
    folder = _copy(saved, tmp_path)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_checkpoint(folder)


def _shard(folder, names_per_shard):
    """Splits model.safetensors into shards (list of name lists) with an index."""
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    os.remove(path)
    weight_map = {}
    for i, names in enumerate(names_per_shard):
        shard = f"model-{i + 1:05d}-of-{len(names_per_shard):05d}.safetensors"
        write_safetensors(os.path.join(folder, shard), {n: tensors[n] for n in names},
                          metadata={"format": "pt"})
        weight_map.update({n: shard for n in names})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tensors


def test_sharded_loads_and_missing_or_duplicate_shards_fail(saved, tmp_path):
    model, params, _ = saved
    folder = _copy(saved, tmp_path)
    names = sorted(read_safetensors(os.path.join(folder, "model.safetensors")))
    tensors = _shard(folder, [names[:5], names[5:]])
    assert_same_params(load_hf_checkpoint(folder)[1], params)

    second = os.path.join(folder, "model-00002-of-00002.safetensors")
    write_safetensors(second, {n: tensors[n] for n in names[4:]})  # names[4] stored twice
    with pytest.raises(ValueError, match="stored twice"):
        load_hf_checkpoint(folder)
    os.remove(second)
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load_hf_checkpoint(folder)


# ----------------------------------------------------------------------------- strictness
def test_config_with_fewer_layers_than_the_weights_fails(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    _edit_config(folder, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"tensor\(s\) that this config does not use: "
                                         r"model\.layers\.1\..*\(\+4 more\).*1 layer"):
        load_hf_checkpoint(folder)


def test_unknown_tensor_fails_unless_allowed(saved, tmp_path):
    model, params, _ = saved
    folder = _copy(saved, tmp_path)
    extra = {"mtp.0.proj.weight": np.ones((16, 32), np.float32),
             "mtp.0.norm.weight": np.ones(16, np.float32)}
    _edit_tensors(folder, lambda t: t.update(extra))
    with pytest.raises(ValueError, match=r"2 tensor\(s\).*mtp\.0\.norm\.weight, mtp\.0\.proj"):
        load_hf_checkpoint(folder)
    assert_same_params(load_hf_checkpoint(folder, allowed_extra=("mtp.",))[1], params)
    with pytest.raises(ValueError, match="mtp.0.proj.weight"):
        load_hf_checkpoint(folder, allowed_extra=("mtp.0.norm",))


def test_rotary_buffers_and_an_equal_tied_head_are_tolerated(tmp_path):
    model = small_model(tie_word_embeddings=True)
    params = model.init_params(jax.random.key(2))
    folder = save_hf_checkpoint(model, params, str(tmp_path / "tied"))
    embed = np.asarray(params["embed"])

    def add(tensors):
        tensors["lm_head.weight"] = embed.copy()
        for i in range(2):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)

    _edit_tensors(folder, add)
    loaded_model, loaded = load_hf_checkpoint(folder)
    assert "lm_head" not in loaded
    assert_same_params(loaded, params)

    _edit_tensors(folder, lambda t: t.update({"lm_head.weight": embed + 1.0}))
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_non_finite_weight_is_named(saved, tmp_path, bad, dtype):
    folder = _copy(saved, tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(tensors):
        for key in tensors:
            tensors[key] = tensors[key].astype(dtype)
        tensors[name][3, 5] = bad

    _edit_tensors(folder, poison)
    with pytest.raises(ValueError, match=rf"{name}.*1 non-finite"):
        load_hf_checkpoint(folder)


# ----------------------------------------------------------------------------- GGUF
def _permute(w, n_head):  # llama.cpp's q/k row permutation (inverse of unpermute_rows)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


_CAST_TYPES = {"F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32}


def write_gguf(path, model, params, *, block_count=None, extra=(), poison=None, quant=None,
               metadata=None):
    """A float32 llama GGUF of `model` (tied when the config is). quant: {tensor name:
    gguf.GGMLQuantizationType} for tensors to store quantized or, for F64 / I8 / I16 / I32,
    cast (the rest stay F32). metadata: {key: value} replacing the config's (None drops the
    key; a str is stored as a string, a bool as a bool, a float as float32, a negative int as
    int32, another int as uint32, a list as an array)."""
    import gguf
    from gguf import GGUFWriter

    cfg = model.config
    writer = GGUFWriter(path, "llama")
    meta = {"llama.block_count": cfg.num_layers if block_count is None else block_count,
            "llama.context_length": cfg.max_position_embeddings,
            "llama.embedding_length": cfg.hidden_size,
            "llama.feed_forward_length": cfg.intermediate_size,
            "llama.attention.head_count": cfg.num_heads,
            "llama.attention.head_count_kv": cfg.num_kv_heads,
            "llama.rope.dimension_count": cfg.head_dim,
            "llama.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            "llama.vocab_size": cfg.vocab_size}
    meta.update(metadata or {})
    for key, value in meta.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif value < 0:
            writer.add_int32(key, value)
        else:
            writer.add_uint32(key, value)
    arrays = to_hf_arrays(model, params)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    suffixes = {"input_layernorm.weight": "attn_norm.weight",
                "post_attention_layernorm.weight": "ffn_norm.weight",
                "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight":
                "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
                "self_attn.o_proj.weight": "attn_output.weight",
                "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                "mlp.down_proj.weight": "ffn_down.weight"}
    tensors = {}
    for hf_name, array in arrays.items():
        if hf_name in names:
            tensors[names[hf_name]] = array
            continue
        _, _, index, suffix = hf_name.split(".", 3)
        if suffix == "self_attn.q_proj.weight":
            array = _permute(array, cfg.num_heads)
        elif suffix == "self_attn.k_proj.weight":
            array = _permute(array, cfg.num_kv_heads)
        tensors[f"blk.{index}.{suffixes[suffix]}"] = array
    tensors.update(dict(extra))
    if poison is not None:
        tensors[poison] = tensors[poison].copy()
        tensors[poison].flat[0] = np.nan
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        kind = (quant or {}).get(name)
        if kind is None:
            writer.add_tensor(name, array)
        elif kind.name in _CAST_TYPES:  # the writer takes these types from the numpy dtype
            writer.add_tensor(name, array.astype(_CAST_TYPES[kind.name]))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_round_trip_and_strictness(tmp_path):
    model = small_model()
    params = model.init_params(jax.random.key(3))
    path = write_gguf(str(tmp_path / "ok.gguf"), model, params)
    loaded_model, loaded = load_gguf_checkpoint(path)
    assert loaded_model.config.num_layers == 2 and not loaded_model.config.tie_word_embeddings
    assert_same_params(loaded, params)

    fewer = write_gguf(str(tmp_path / "fewer.gguf"), model, params, block_count=1)
    with pytest.raises(ValueError, match=r"fewer\.gguf: 9 tensor\(s\) that this config does not "
                                         r"use: blk\.1\..*block_count is 1"):
        load_gguf_checkpoint(fewer)

    extra = write_gguf(str(tmp_path / "extra.gguf"), model, params,
                       extra={"nextn.0.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"nextn\.0\.weight"):
        load_gguf_checkpoint(extra)
    assert_same_params(load_gguf_checkpoint(extra, allowed_extra=("nextn.",))[1], params)

    poisoned = write_gguf(str(tmp_path / "nan.gguf"), model, params, poison="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"nan\.gguf: tensor 'blk\.1\.ffn_up\.weight' holds 1 "
                                         r"non-finite"):
        load_gguf_checkpoint(poisoned)


def test_gguf_f64_tensors_load_and_integer_tensors_are_refused_before_reading(tmp_path,
                                                                             monkeypatch):
    import gguf

    from jaxgen.models import gguf_checkpoint

    model = small_model()
    params = model.init_params(jax.random.key(3))
    kinds = gguf.GGMLQuantizationType
    wide = write_gguf(str(tmp_path / "f64.gguf"), model, params,
                      quant={"blk.0.attn_q.weight": kinds.F64, "token_embd.weight": kinds.F64})
    assert_same_params(load_gguf_checkpoint(wide)[1], params)  # float32 -> float64 is exact

    read = []
    original = gguf_checkpoint._dequantize
    monkeypatch.setattr(gguf_checkpoint, "_dequantize", lambda t: read.append(t) or original(t))
    for kind in (kinds.I8, kinds.I32):
        path = write_gguf(str(tmp_path / f"{kind.name}.gguf"), model, params,
                          quant={"blk.1.ffn_up.weight": kind})
        with pytest.raises(ValueError, match=rf"{kind.name}\.gguf: tensor 'blk\.1\.ffn_up\."
                                             rf"weight' has type {kind.name} \(integer tensors "
                                             rf"are not weights\); supported: F32, F16, .*Q8_0"
                                             rf".*F64"):
            load_gguf_checkpoint(path)
    assert read == [], "tensors were read before the integer tensor was refused"


@pytest.mark.parametrize("damage", ["truncated", "offset"])
def test_gguf_tensor_past_the_end_of_the_file_is_named(tmp_path, damage):
    from gguf import GGUFReader

    model = small_model()
    path = write_gguf(str(tmp_path / "m.gguf"), model, model.init_params(jax.random.key(3)))
    if damage == "truncated":  # the last 4 bytes of the last tensor's data are gone
        damaged = max(GGUFReader(path).tensors, key=lambda t: t.data_offset).name
        os.truncate(path, os.path.getsize(path) - 4)
    else:  # the first tensor's offset (its header field's last part) points far away
        reader = GGUFReader(path, "r+")
        damaged = reader.tensors[0].name
        reader.tensors[0].field.parts[-1][0] = 10**9
        reader.data.flush()
        del reader
    with pytest.raises(ValueError, match=rf"m\.gguf: tensor '{re.escape(damaged)}' \(F32, "
                                         rf"shape \[\d+(, \d+)*\]\) lies past the end of the "
                                         rf"file: its data spans bytes \[\d+, \d+\) but the "
                                         rf"file has {os.path.getsize(path)} bytes"):
        load_gguf_checkpoint(path)


# ----------------------------------------------------------------------------- check_params
@pytest.fixture(scope="module")
def tied_and_untied():
    out = {}
    for tied in (False, True):
        model = small_model(tie_word_embeddings=tied, attention_bias=True)
        out[tied] = (model, model.init_params(jax.random.key(4)))
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_check_params_accepts_both_layouts(tied_and_untied, tied):
    model, params = tied_and_untied[tied]
    assert model.check_params(params) is None
    fast = unstack_layers(model, params)
    assert model.check_params(fast) is None
    assert model.check_params(dict(fast, layers=tuple(fast["layers"]))) is None
    assert model.check_params(jax.eval_shape(lambda: params)) is None
    assert model.check_params(jax.eval_shape(lambda: fast)) is None
    if tied:  # a tied model may carry its own [D, V] head in either layout
        head = jnp.zeros((16, 40))
        assert model.check_params(dict(params, lm_head=head)) is None


def test_check_params_names_the_first_mismatch(tied_and_untied):
    model, params = tied_and_untied[False]
    deeper = small_model(num_layers=3, attention_bias=True)
    with pytest.raises(ValueError, match=re.escape(
            "params['layers']['attn_norm'] has shape (3, 16), expected (2, 16) for this model")):
        model.check_params(jax.eval_shape(deeper.init_params, jax.random.key(0)))
    layers = dict(params["layers"], wq=jnp.zeros((2, 16, 8)))
    with pytest.raises(ValueError, match=re.escape(
            "params['layers']['wq'] has shape (2, 16, 8), expected (2, 16, 16) for this model")):
        model.check_params(dict(params, layers=layers))
    with pytest.raises(ValueError, match=re.escape(
            "params['lm_head'] has shape (40, 16), expected (16, 40)")):
        model.check_params(dict(params, lm_head=params["embed"]))
    fast = unstack_layers(model, params)
    fast["layers"][1] = dict(fast["layers"][1], w_up=jnp.zeros((16, 25)))
    with pytest.raises(ValueError, match=re.escape(
            "params['layers'][1]['w_up'] has shape (16, 25), expected (16, 24)")):
        model.check_params(fast)


def test_check_params_missing_extra_keys_and_layer_count(tied_and_untied):
    model, params = tied_and_untied[False]
    no_head = {k: v for k, v in params.items() if k != "lm_head"}
    with pytest.raises(ValueError, match=r"params has no key 'lm_head' \(expected shape \(16, 40\)"):
        model.check_params(no_head)
    no_bias = dict(params, layers={k: v for k, v in params["layers"].items() if k != "bq"})
    with pytest.raises(ValueError, match=r"params\['layers'\] has no key 'bq'"):
        model.check_params(no_bias)
    with pytest.raises(ValueError, match=r"params has an unexpected key 'extra'"):
        model.check_params(dict(params, extra=jnp.zeros(3)))
    with pytest.raises(ValueError, match=r"params carry 'mtp' \(MTP layers\) but the model's "
                                         r"config has num_mtp_layers=0"):
        model.check_params(dict(params, mtp=jnp.zeros(3)))
    with pytest.raises(ValueError, match=r"params\['layers'\] has an unexpected key 'bo'"):
        model.check_params(dict(params, layers=dict(params["layers"], bo=jnp.zeros((2, 16)))))
    fast = unstack_layers(model, params)
    with pytest.raises(ValueError, match=r"list of 1 layer\(s\), expected 2"):
        model.check_params(dict(fast, layers=fast["layers"][:1]))
    with pytest.raises(ValueError, match=r"params\['layers'\]\[0\] has an unexpected key 'x'"):
        model.check_params(dict(fast, layers=[dict(fast["layers"][0], x=1), fast["layers"][1]]))
    with pytest.raises(ValueError, match=r"params\['embed'\] is a float, expected an array"):
        model.check_params(dict(params, embed=1.0))
    with pytest.raises(ValueError, match=r"params is a list"):
        model.check_params([params])


def test_check_params_is_host_only_and_works_on_tracers(tied_and_untied):
    model, params = tied_and_untied[True]
    seen = []

    @jax.jit
    def checked(p):
        model.check_params(p)  # runs while tracing: p holds tracers
        seen.append(True)
        return p["embed"].sum()

    checked(params)
    assert seen == [True]
    bad = dict(params, embed=jnp.zeros((41, 16)))
    with pytest.raises(ValueError, match=r"params\['embed'\] has shape \(41, 16\)"):
        checked(bad)


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4", "glm4_moe", "deepseek_v3"])
def test_int8_weights_of_a_float_only_family_are_refused_before_reading(tmp_path, model_type):
    """The folder holds only a config.json: the refusal comes before any config field or
    weight is read."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ValueError, match=rf"weights='int8' is not available for "
                                         rf"'{model_type}' models .*allowed: 'float'"):
        load(str(tmp_path), weights="int8")
