"""Every number of a model config is checked before anything is allocated or read: config.json
(HF folders), GGUF metadata, the MTP drafter's config.json, LlamaConfig itself. A bad number
is a ValueError naming the field, the value and what is allowed; the CLI exits with the
"bad model" code (3). Failing fast is asserted by counting the weights read (none), never by
timing."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import jax
import pytest

from jaxgen.models import LlamaConfig, gguf_checkpoint
from jaxgen.models.gguf_checkpoint import load_gguf_checkpoint
from jaxgen.models.hf_checkpoint import load_hf_checkpoint
from jaxgen.models.hf_export import save_hf_checkpoint
from jaxgen.models.safetensors_io import SafetensorsFile
from tests.test_loader_checks import SMALL, small_model, write_gguf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-layer HF folder (vocab 40, hidden 16, 4 heads of 4, 2 kv heads, mlp 24)."""
    model = small_model()
    params = model.init_params(jax.random.key(1))
    return model, params, save_hf_checkpoint(model, params, str(tmp_path_factory.mktemp("hf")))


@pytest.fixture
def reads(monkeypatch):
    """Counts the tensors read from safetensors files (data, not headers)."""
    count = []
    original = SafetensorsFile.__getitem__

    def counting(self, name):
        count.append(name)
        return original(self, name)

    monkeypatch.setattr(SafetensorsFile, "__getitem__", counting)
    return count


def _with_config(saved, tmp_path, **changes) -> str:
    folder = shutil.copytree(saved[2], str(tmp_path / "m"))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key)
        else:
            config[key] = value
    with open(path, "w") as f:
        json.dump(config, f)  # allow_nan: Infinity / NaN are written as json.load reads them
    return folder


_DROP = object()

HF_CASES = [  # config.json change -> the error it gives
    (dict(num_hidden_layers=10**9), r"num_hidden_layers=1000000000 is out of range; allowed: "
                                    r"an int in \[1, 1024\]"),
    (dict(num_hidden_layers=3), r"num_hidden_layers=3 needs layers 0\.\.2, but the checkpoint "
                                r"holds 2 layer\(s\) \(model\.layers\.\{i\}\. for i in 0\.\.1\)"),
    (dict(num_hidden_layers=0), r"num_hidden_layers=0 is out of range"),
    (dict(rope_theta=0), r"rope_theta=0 is out of range; allowed: a finite float in \(0, "),
    (dict(rope_theta=-1.0), r"rope_theta=-1\.0 is out of range"),
    (dict(rope_theta=math.inf), r"rope_theta=inf is out of range"),
    (dict(rope_theta="10000"), r"rope_theta='10000' is out of range"),
    (dict(rms_norm_eps=-1), r"rms_norm_eps=-1 is out of range; allowed: a finite float in "
                            r"\(0, 1\]"),
    (dict(rms_norm_eps=0.0), r"rms_norm_eps=0\.0 is out of range"),
    (dict(rms_norm_eps=math.nan), r"rms_norm_eps=nan is out of range"),
    (dict(max_position_embeddings=-1), r"max_position_embeddings=-1 is out of range; allowed: "
                                       r"an int in \[1, 2147483647\]"),
    (dict(vocab_size=0), r"vocab_size=0 is out of range"),
    (dict(vocab_size=2**40), r"vocab_size=1099511627776 is out of range; allowed: an int in "
                             r"\[1, 16777216\]"),
    (dict(vocab_size=41), r"tensor 'model\.embed_tokens\.weight' has shape \(40, 16\), but the "
                          r"config implies \(41, 16\) \(vocab_size=41, hidden_size=16\)"),
    (dict(intermediate_size=25), r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has "
                                 r"shape \(16, 24\), but the config implies \(16, 25\) "
                                 r"\(hidden_size=16, intermediate_size=25\)"),
    (dict(intermediate_size="24"), r"intermediate_size='24' \(str, not an int\) is out of "
                                   r"range"),
    (dict(intermediate_size=24.0), r"intermediate_size=24\.0 \(float, not an int\)"),
    (dict(num_key_value_heads=True), r"num_key_value_heads=True \(bool, not an int\)"),
    (dict(num_key_value_heads=3), r"num_key_value_heads=3 must divide num_attention_heads=4"),
    (dict(head_dim=5), r"head_dim=5 is odd; allowed: an even int"),
    (dict(head_dim=_DROP, hidden_size=18), r"hidden_size=18 is not a multiple of "
                                           r"num_attention_heads=4 and there is no head_dim"),
    (dict(hidden_size=_DROP), r"config\.json has no 'hidden_size'; allowed: an int in"),
    (dict(eos_token_id=40), r"eos_token_id=\(40,\) is outside the vocabulary; allowed: token "
                            r"ids in \[0, vocab_size=40\)"),
    (dict(pad_token_id=-1), r"pad_token_id=-1 is outside the vocabulary"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}),
     r"rope_scaling\.factor=0 is out of range; allowed: a finite float in \[1, "),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                        "high_freq_factor": 4.0}),
     r"high_freq_factor=4\.0 must be greater than low_freq_factor=4\.0"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": math.inf}),
     r"rope_scaling\.factor=inf is out of range"),
    (dict(rope_scaling="linear"), r"rope_scaling='linear'; allowed: an object or null"),
    (dict(tie_word_embeddings="false"), r"tie_word_embeddings='false'; allowed: true or false"),
    (dict(num_mtp_layers=10**6), r"num_mtp_layers=1000000 is out of range; allowed: an int in "
                                 r"\[0, 64\]"),
]


@pytest.mark.parametrize("changes, message", HF_CASES,
                         ids=[",".join(c) + f"-{i}" for i, (c, _) in enumerate(HF_CASES)])
def test_bad_config_number_fails_before_any_weight_is_read(saved, tmp_path, reads, changes,
                                                           message):
    folder = _with_config(saved, tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as error:
        load_hf_checkpoint(folder)
    assert folder in str(error.value), "the error names the file"
    assert reads == [], f"weights were read before the config was refused: {reads[:3]}"


def test_a_good_config_still_loads_and_reads_every_weight(saved, reads):
    model, _, folder = saved
    loaded, _ = load_hf_checkpoint(folder)
    assert loaded == model and len(reads) == 2 + 2 * 9 + 1  # embed, norm, head + 2 x 9 layer


def test_config_json_that_is_not_an_object(saved, tmp_path):
    folder = shutil.copytree(saved[2], str(tmp_path / "m"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump([1, 2], f)
    with pytest.raises(ValueError, match=r"config\.json holds a list, expected an object"):
        load_hf_checkpoint(folder)


@pytest.mark.parametrize("field, value, message", [
    ("rope_theta", 0.0, r"rope_theta=0\.0 is out of range"),
    ("rope_theta", math.nan, r"rope_theta=nan is out of range"),
    ("rms_norm_eps", -1.0, r"rms_norm_eps=-1\.0 is out of range"),
    ("max_position_embeddings", 0, r"max_position_embeddings=0 is out of range"),
    ("num_layers", 10**9, r"num_layers=1000000000 is out of range"),
    ("head_dim", 3, r"head_dim=3 is odd"),
    ("sliding_window", 0, r"sliding_window=0 is out of range"),
    ("bos_token_id", 40, r"bos_token_id=40 is outside the vocabulary"),
])
def test_llama_config_refuses_a_bad_number_whatever_built_it(field, value, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**SMALL, field: value})


def test_dynamic_rope_needs_a_head_dim_above_two():
    with pytest.raises(ValueError, match=r"head_dim=2 with rope_type 'dynamic'"):
        LlamaConfig(**{**SMALL, "num_heads": 2, "num_kv_heads": 2, "head_dim": 2},
                    rope_scaling=(("factor", 2.0), ("rope_type", "dynamic")))


# ----------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def small_params():
    model = small_model()
    return model, model.init_params(jax.random.key(3))


@pytest.fixture
def dequantized(monkeypatch):
    """Counts the GGUF tensors dequantized (read)."""
    count = []
    original = gguf_checkpoint._dequantize

    def counting(tensor):
        count.append(tensor.name)
        return original(tensor)

    monkeypatch.setattr(gguf_checkpoint, "_dequantize", counting)
    return count


GGUF_CASES = [  # metadata override -> the error it gives
    ({"llama.block_count": 10**9}, r"llama\.block_count=1000000000 is out of range; allowed: "
                                   r"an int in \[1, 1024\]"),
    ({"llama.block_count": 3}, r"llama\.block_count=3 needs layers 0\.\.2, but the checkpoint "
                               r"holds 2 layer\(s\) \(blk\.\{i\}\. for i in 0\.\.1\)"),
    ({"llama.rope.freq_base": 0.0}, r"llama\.rope\.freq_base=0\.0 is out of range"),
    ({"llama.rope.freq_base": math.inf}, r"llama\.rope\.freq_base=inf is out of range"),
    ({"llama.attention.layer_norm_rms_epsilon": -1.0},
     r"llama\.attention\.layer_norm_rms_epsilon=-1\.0 is out of range"),
    ({"llama.context_length": -1}, r"llama\.context_length=-1 is out of range"),
    ({"llama.attention.head_count": 4.0}, r"llama\.attention\.head_count=4\.0 \(float, not an "
                                          r"int\)"),
    ({"llama.attention.head_count_kv": 3}, r"llama\.attention\.head_count_kv=3 must divide "
                                           r"llama\.attention\.head_count=4"),
    ({"llama.vocab_size": 41}, r"tensor 'token_embd\.weight' has shape \(40, 16\), but the "
                               r"config implies \(41, 16\) \(llama\.vocab_size=41, "
                               r"llama\.embedding_length=16\)"),
    ({"llama.feed_forward_length": 2**30}, r"llama\.feed_forward_length=1073741824 is out of "
                                           r"range"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0},
     r"llama\.rope\.scaling\.factor=0\.0 is out of range; allowed: a finite float in \[1, "),
    ({"llama.attention.key_length": 8}, r"llama\.rope\.dimension_count=4 differs from "
                                        r"llama\.attention\.key_length=8; allowed: equal values"),
    ({"llama.attention.key_length": 4, "llama.attention.value_length": 8},
     r"llama\.attention\.value_length=8 differs from llama\.attention\.key_length=4"),
    ({"llama.attention.key_length": 10**6}, r"llama\.attention\.key_length=1000000 is out of "
                                            r"range"),
]


@pytest.mark.parametrize("metadata, message", GGUF_CASES,
                         ids=[",".join(m) for m, _ in GGUF_CASES])
def test_bad_gguf_metadata_fails_before_any_tensor_is_read(tmp_path, small_params, dequantized,
                                                           metadata, message):
    model, params = small_params
    path = write_gguf(str(tmp_path / "m.gguf"), model, params, metadata=metadata)
    with pytest.raises(ValueError, match=message) as error:
        load_gguf_checkpoint(path)
    assert "m.gguf" in str(error.value)
    assert dequantized == [], "tensors were read before the metadata was refused"


def test_gguf_key_length_is_the_head_size(tmp_path):
    """llama.cpp writes attention.key_length when the head size is not hidden / heads."""
    model = small_model(head_dim=8)  # hidden 16 / 4 heads would give 4
    params = model.init_params(jax.random.key(3))
    path = write_gguf(str(tmp_path / "m.gguf"), model, params,
                      metadata={"llama.rope.dimension_count": None,
                                "llama.attention.key_length": 8,
                                "llama.attention.value_length": 8})
    loaded_model, _ = load_gguf_checkpoint(path)
    assert loaded_model.config.head_dim == 8


# ----------------------------------------------------------------------------- MTP drafter
@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=10**9), r"hidden_size=1000000000 is out of range; allowed: an int in "
                              r"\[1, 65536\]"),
    (dict(rms_norm_eps=0), r"rms_norm_eps=0 is out of range"),
    (dict(rms_norm_eps="x"), r"rms_norm_eps='x' is out of range"),
    (dict(num_hidden_layers=10**9), r"num_layers=1000000000 is out of range"),
])
def test_mtp_drafter_config_numbers(tmp_path, changes, message):
    from jaxgen.models import tiny_llama
    from jaxgen.models.mtp_drafter import MtpDrafterConfig, MtpDrafterModel
    from jaxgen.models.mtp_drafter_io import load_mtp_drafter, save_mtp_drafter

    target, _ = tiny_llama()
    drafter = MtpDrafterModel(MtpDrafterConfig.for_target(
        target.config, hidden_size=8, intermediate_size=16, num_layers=1))
    folder = save_mtp_drafter(drafter, drafter.init_params(jax.random.key(0)),
                              str(tmp_path / "drafter"))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        load_mtp_drafter(folder)


# ----------------------------------------------------------------------------- the CLI
def test_cli_exits_with_the_bad_model_code_naming_the_field(saved, tmp_path):
    folder = _with_config(saved, tmp_path, num_hidden_layers=10**9)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", JAXGEN_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-m", "jaxgen.cli.main", "--model", folder,
                             "--max-new-tokens", "1", "Hi"], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 3, result.stderr
    assert "num_hidden_layers=1000000000 is out of range" in result.stderr
    assert "Traceback" not in result.stderr
