"""GenerationConfig: every Hugging Face field is classified, refused values raise naming the
field, per-row dynamic values, and the int32 range of every int field."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.config import generation as C
from jaxgen.api.generate import default_config
from jaxgen.config.generation import GenerationConfig
from jaxgen.models import Llama, LlamaConfig
from jaxgen.models.rope import freeze

transformers = pytest.importorskip("transformers")

HF_FIELDS = set(transformers.GenerationConfig().to_dict())
HF_DEFAULT_VALUES = transformers.GenerationConfig._get_default_generation_params()
REFUSED = set(C.NOT_YET_SUPPORTED) | set(C.HF_FIELDS_UNSUPPORTED)

# One non-neutral value per refused field.
NON_NEUTRAL = {
    "speculation_type": "dflash",
    "num_beam_groups": 2,
    "diversity_penalty": 0.5,
    "penalty_alpha": 0.6,
    "dola_layers": "high",
    "force_words_ids": [[1]],
    "constraints": [object()],
    "low_memory": True,
    "encoder_repetition_penalty": 1.2,
    "encoder_no_repeat_ngram_size": 3,
    "decoder_start_token_id": 0,
    "token_healing": True,
    "output_attentions": True,
    "output_hidden_states": True,
    "compile_config": {"fullgraph": True},
    "disable_compile": True,
    "continuous_batching_config": {"max_batch_tokens": 256},
    "is_assistant": True,
}


# ------------------------------------------------------------------ field coverage
def test_every_hf_field_is_implemented_refused_or_bookkeeping():
    known = set(C.HF_DEFAULTS) | set(C.HF_FIELDS_UNSUPPORTED) | set(C.BOOKKEEPING_FIELDS)
    assert sorted(HF_FIELDS - known) == []
    documented = set(re.findall(r"^\s{8}(\w+)\s*\(`", transformers.GenerationConfig.__doc__,
                                re.M))
    assert len(documented) > 50 and sorted(documented - known) == []
    assert set(C.NOT_YET_SUPPORTED) <= set(C.HF_DEFAULTS)
    assert not set(C.HF_FIELDS_UNSUPPORTED) & set(C.HF_DEFAULTS)
    # the jaxgen-only fields are exactly the implemented fields HF does not have
    assert set(C.HF_DEFAULTS) - HF_FIELDS == set(C.JAXGEN_FIELDS)
    assert set(C.DYNAMIC_FIELDS) <= set(C.HF_DEFAULTS)


def test_hf_defaults_match_transformers():
    for name, value in HF_DEFAULT_VALUES.items():
        if name in C.HF_DEFAULTS:
            assert C.HF_DEFAULTS[name] == value, name
        else:
            neutral, _ = C.HF_FIELDS_UNSUPPORTED[name]
            assert value in neutral, name
    GenerationConfig(**HF_DEFAULT_VALUES)  # HF's own defaults always load


def test_the_non_neutral_table_covers_every_refused_field():
    assert set(NON_NEUTRAL) == REFUSED


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_field_raises_naming_it(name):
    with pytest.raises(ValueError, match=rf"`{name}`=.*\(allowed: .*\)"):
        GenerationConfig(**{name: NON_NEUTRAL[name]})
    with pytest.raises(ValueError, match=rf"`{name}`"):
        GenerationConfig(max_new_tokens=4).replace(**{name: NON_NEUTRAL[name]})


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_field_accepts_its_neutral_values(name):
    GenerationConfig(**{name: None})
    if name in C.NOT_YET_SUPPORTED:
        GenerationConfig(**{name: C.HF_DEFAULTS[name]})
    else:
        for value in C.HF_FIELDS_UNSUPPORTED[name][0]:
            GenerationConfig(**{name: value})


def test_messages_say_why():
    with pytest.raises(ValueError, match="assistant_lookbehind.*int >= 1.*got 0"):
        GenerationConfig(assistant_lookbehind=0)
    with pytest.raises(ValueError, match="jax.jit"):
        GenerationConfig(disable_compile=True)
    with pytest.raises(ValueError, match="encoder-decoder"):
        GenerationConfig(decoder_start_token_id=2)
    with pytest.raises(ValueError, match="DFlash"):
        GenerationConfig(speculation_type="dflash")


def test_bookkeeping_keys_are_ignored():
    cfg = GenerationConfig(transformers_version="5.0.0", _from_model_config=True,
                           _commit_hash="abc", _original_object_hash=3, max_new_tokens=4)
    assert cfg == GenerationConfig(max_new_tokens=4)


def test_generation_config_json_written_by_transformers_loads(tmp_path):
    hf = transformers.GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[2, 7], pad_token_id=0,
        assistant_lookbehind=10, target_lookbehind=10, disable_compile=False,
        cache_implementation="static", max_cache_len=64, prefill_chunk_size=16)
    hf.save_pretrained(tmp_path)
    cfg = GenerationConfig.from_pretrained(tmp_path)
    assert (cfg.temperature, cfg.top_p, cfg.eos_ids) == (0.6, 0.9, (2, 7))
    assert (cfg.max_cache_len, cfg.prefill_chunk_size) == (64, 16)
    (tmp_path / "generation_config.json").write_text(
        '{"assistant_lookbehind": 0, "transformers_version": "5.0.0"}')
    with pytest.raises(ValueError, match="assistant_lookbehind"):
        GenerationConfig.from_pretrained(tmp_path)


def test_a_bad_generation_config_json_value_names_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": -1}')
    with pytest.raises(ValueError, match=r"generation_config\.json: `max_new_tokens` must be"):
        GenerationConfig.from_pretrained(tmp_path)
    assert GenerationConfig.from_pretrained(tmp_path, max_new_tokens=4).max_new_tokens == 4
    with pytest.raises(ValueError, match=r"^`top_k` must be"):  # the caller's own value
        GenerationConfig.from_pretrained(tmp_path, max_new_tokens=4, top_k=-2)
    # a loaded model's defaults: named when generate resolves them, overridable by the call
    model = Llama(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=1,
                              num_heads=2, num_kv_heads=1, head_dim=8,
                              generation_defaults=freeze({"temperature": "hot"})))
    with pytest.raises(ValueError, match=r"^the model's generation_config\.json .*: "
                                         r"`temperature` must be a float"):
        default_config(model)
    assert default_config(model, temperature=0.5).temperature == 0.5
    with pytest.raises(ValueError, match=r"^`top_p` must be"):
        default_config(model, temperature=0.5, top_p=7.0)


# ------------------------------------------------------- max_cache_len / prefill chunks
@pytest.mark.parametrize("name", ["max_cache_len", "prefill_chunk_size"])
def test_static_size_fields(name):
    assert name in C.STATIC_FIELDS and C.HF_DEFAULTS[name] is None
    cfg = GenerationConfig(**{name: 64})
    assert getattr(cfg, name) == 64 and getattr(cfg.replace(**{name: None}), name) is None
    # part of the compiled program: the PyTree structure changes with it
    assert (jax.tree_util.tree_structure(cfg)
            != jax.tree_util.tree_structure(cfg.replace(**{name: 32})))
    for bad in (0, -1, 1.5, "64", True, np.array([4])):
        with pytest.raises(ValueError, match=rf"`{name}` must be an int >= 1"):
            GenerationConfig(**{name: bad})


# ------------------------------------------------------------------ int32 range
INT_FIELDS = {  # field -> extra fields that make the config otherwise valid
    "max_new_tokens": {}, "max_length": {}, "min_length": {}, "min_new_tokens": {},
    "num_beams": {}, "num_return_sequences": {"num_beams": 2**31 - 1},
    "no_repeat_ngram_size": {}, "top_k": {"do_sample": True},
    "eos_token_id": {}, "pad_token_id": {}, "bos_token_id": {}, "forced_bos_token_id": {},
    "forced_eos_token_id": {}, "num_assistant_tokens": {}, "max_assistant_tokens": {},
    "prompt_lookup_num_tokens": {}, "max_matching_ngram_size": {}, "max_cache_len": {},
    "prefill_chunk_size": {},
}


@pytest.mark.parametrize("name", sorted(INT_FIELDS))
@pytest.mark.parametrize("big", [2**31, 10**12, np.int64(2**40)])
def test_ints_past_int32_are_refused_naming_the_field(name, big):
    with pytest.raises(ValueError, match=rf"`{name}`.*2\*\*31 - 1 = 2147483647"):
        GenerationConfig(**INT_FIELDS[name], **{name: big})


@pytest.mark.parametrize("name", sorted(INT_FIELDS))
def test_int32_max_is_accepted(name):
    cfg = GenerationConfig(**INT_FIELDS[name], **{name: 2**31 - 1})
    value = getattr(cfg, name)
    assert (value == (2**31 - 1,)) if isinstance(value, tuple) else value == 2**31 - 1


@pytest.mark.parametrize("fields,name", [
    (dict(eos_token_id=[2, 2**31]), "eos_token_id"),
    (dict(bad_words_ids=[[1, 2**33]]), "bad_words_ids"),
    (dict(sequence_bias=[[[2**31], -1.0]]), "sequence_bias"),
    (dict(sequence_bias={(1, 2**31): 2.0}), "sequence_bias"),
    (dict(suppress_tokens=[2**31]), "suppress_tokens"),
    (dict(begin_suppress_tokens=[1, 2**31]), "begin_suppress_tokens"),
    (dict(forced_eos_token_id=[3, 2**31]), "forced_eos_token_id"),
    (dict(exponential_decay_length_penalty=(2**31, 1.1)), "exponential_decay_length_penalty"),
    (dict(top_k=[5, 2**31], do_sample=True), "top_k"),
    (dict(top_k=[5, 10**30], do_sample=True), "top_k"),
    (dict(min_length=np.array([1, 2**40])), "min_length"),
    (dict(min_new_tokens=(0, 2**31)), "min_new_tokens"),
])
def test_ids_and_per_row_ints_past_int32(fields, name):
    with pytest.raises(ValueError, match=rf"`{name}`.*2147483647"):
        GenerationConfig(**fields)


def test_floats_past_float32_are_refused():
    with pytest.raises(ValueError, match=r"`temperature`.*overflows float32"):
        GenerationConfig(do_sample=True, temperature=1e39)
    with pytest.raises(ValueError, match=r"`repetition_penalty`.*overflows float32"):
        GenerationConfig(repetition_penalty=[1.0, 1e300])


# ------------------------------------------------------------------ per-row values
FLOAT_ROWS = {"temperature": [0.5, 0.7], "top_p": [0.9, 1.0], "min_p": [0.0, 0.1], "top_h": [0.4, 1.0],
              "typical_p": [0.5, 1.0], "epsilon_cutoff": [0.0, 3e-4], "eta_cutoff": [1e-3, 0.0],
              "repetition_penalty": [1.2, 1.0], "presence_penalty": [0.5, 0.0],
              "frequency_penalty": [0.0, -0.5], "length_penalty": [1.0, 2.0],
              "assistant_ensemble_weight": [0.5, 0.9],
              "assistant_confidence_threshold": [0.4, 0.2], "guidance_scale": [1.5, 3.0]}
INT_ROWS = {"top_k": [5, 0], "min_length": [0, 4], "min_new_tokens": [1, 2],
            "prompt_ignore_length": [0, 3]}


def test_the_per_row_table_covers_every_dynamic_field():
    assert set(FLOAT_ROWS) | set(INT_ROWS) == set(C.DYNAMIC_FIELDS)


def _forms(values):
    return {"list": list(values), "tuple": tuple(values), "numpy": np.asarray(values),
            "jax": jnp.asarray(values)}


@pytest.mark.parametrize("name", sorted(C.DYNAMIC_FIELDS))
def test_dynamic_fields_take_lists_tuples_and_arrays(name):
    values = {**FLOAT_ROWS, **INT_ROWS}[name]
    base = dict(do_sample=True)
    configs = {form: GenerationConfig(**base, **{name: v}) for form, v in _forms(values).items()}
    for form in ("list", "tuple"):
        assert isinstance(getattr(configs[form], name), np.ndarray)
    structures = {jax.tree_util.tree_structure(c) for c in configs.values()}
    assert len(structures) == 1  # same static part and processor set: one compile key
    first = configs["list"]
    for cfg in configs.values():
        assert cfg == first
        cfg.validate_for_batch(2)
        leaves = jax.tree_util.tree_leaves(cfg)  # one leaf per non-None dynamic field
        assert len(leaves) == sum(getattr(cfg, n) is not None for n in C.DYNAMIC_FIELDS)
    assert name in first.active_dynamic() or name == "length_penalty"
    with pytest.raises(ValueError, match=rf"`{name}` has 2 values but the batch has 3 rows; "
                                         r"pass one value or one per row"):
        first.validate_for_batch(3)


def test_list_numpy_and_jax_values_share_one_trace():
    traces = []

    @jax.jit
    def run(cfg):
        traces.append(1)
        return cfg.temperature * cfg.top_k

    for temps in _forms([0.5, 0.7]).values():
        run(GenerationConfig(do_sample=True, temperature=temps, top_k=[3, 4]))
    assert len(traces) == 1
    np.testing.assert_allclose(
        run(GenerationConfig(do_sample=True, temperature=[0.5, 0.25], top_k=(2, 4))), [1.0, 1.0])
    assert len(traces) == 1


def test_scalar_and_per_row_configs():
    scalar = GenerationConfig(do_sample=True, temperature=0.5)
    rows = GenerationConfig(do_sample=True, temperature=[0.5, 0.5])
    assert scalar != rows  # different values (and leaf shapes)
    assert scalar.active_dynamic() == rows.active_dynamic()
    assert jax.tree_util.tree_structure(scalar) == jax.tree_util.tree_structure(rows)
    assert scalar == GenerationConfig(do_sample=True, temperature=np.float64(0.5))
    assert rows.replace(top_p=0.9).temperature.tolist() == [0.5, 0.5]
    # a per-row value equal to the default everywhere adds no processor
    assert "repetition_penalty" not in GenerationConfig(
        repetition_penalty=[1.0, 1.0]).active_dynamic()


@pytest.mark.parametrize("fields,match", [
    (dict(temperature=[]), "`temperature` must be a number or a 1-D list"),
    (dict(temperature=[[0.5], [0.7, 0.9]]), "`temperature` must be a number or a 1-D list"),
    (dict(temperature=[[0.5, 0.7]]), r"`temperature` must be .*shape \(1, 2\)"),
    (dict(temperature=[0.5, "hot"]), "`temperature`"),
    (dict(top_p=[0.5, 1.5]), r"`top_p` must be a float in \(0, 1\]"),
    (dict(min_p=[0.1, None]), "`min_p`"),
    (dict(top_k=[5, -1]), "`top_k` must be an int >= 0"),
    (dict(top_k=[5.0, 2.0]), "`top_k` must be an int >= 0"),
    (dict(min_length=[1, True]), "`min_length`"),
    (dict(do_sample=True, temperature=[0.5, 0.0]), "temperature"),
])
def test_bad_per_row_values(fields, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**fields)


def test_validate_for_batch_shapes():
    GenerationConfig().validate_for_batch(5)  # scalars fit any batch
    cfg = GenerationConfig(do_sample=True, temperature=np.full((2, 3), 0.5))  # a vmap sweep
    with pytest.raises(ValueError, match=r"`temperature` has shape \(2, 3\) but a per-row "
                                         r"value is 1-D \(the batch has 3 rows\)"):
        cfg.validate_for_batch(3)
    # under vmap the mapped field holds one row of the sweep: its shape is checked
    jax.vmap(lambda c: c.validate_for_batch(3), in_axes=(cfg.vmap_axes(temperature=0),))(cfg)
    with pytest.raises(ValueError, match="`temperature` has 3 values but the batch has 4"):
        jax.vmap(lambda c: c.validate_for_batch(4),
                 in_axes=(cfg.vmap_axes(temperature=0),))(cfg)
    for bad in (0, -2, 2.0, 2**31):
        with pytest.raises(ValueError, match="`batch`"):
            cfg.validate_for_batch(bad)
