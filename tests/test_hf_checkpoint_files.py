"""A HF folder's files as the loaders read them: the shard names of the index stay inside the
folder, symlinks are followed (the HF hub cache layout), tensor dtypes are checked from the
headers before any data is read, and a bad JSON file is a ValueError naming it."""
from __future__ import annotations

import json
import os
import shutil
import struct
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxgen.models import Llama, LlamaConfig, load
from jaxgen.models.deepseek_checkpoint import load_deepseek_v3_config
from jaxgen.models.gemma4_assistant import load_gemma4_assistant
from jaxgen.models.gemma4_checkpoint import read_config as read_gemma4_config
from jaxgen.models.gemma_checkpoint import load_gemma_config
from jaxgen.models.glm4_checkpoint import load_glm4_moe_config
from jaxgen.models.hf_checkpoint import load_hf_checkpoint, load_hf_config
from jaxgen.models.hf_export import save_hf_checkpoint
from jaxgen.models.mtp_drafter_io import load_mtp_drafter
from jaxgen.models.safetensors_io import SafetensorsFile, read_safetensors, write_safetensors

SMALL = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "BOOL": 1, "I32": 4, "U64": 8, "C64": 8,
               "F16": 2, "F64": 8}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(params, folder) of a 2-layer Llama saved as a HF folder."""
    model = Llama(LlamaConfig(**SMALL))
    params = model.init_params(jax.random.key(1))
    return params, save_hf_checkpoint(model, params, str(tmp_path_factory.mktemp("hf")))


@pytest.fixture
def folder(saved, tmp_path) -> str:
    return shutil.copytree(saved[1], str(tmp_path / "m"))


def _shard(folder: str, entry_of=None) -> tuple[str, str]:
    """Splits model.safetensors into two shards with an index; entry_of(name, shard) may
    replace a weight_map value. Returns (index path, the first tensor's name)."""
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    os.remove(path)
    names = sorted(tensors)
    weight_map = {}
    for shard, part in (("s1.safetensors", names[:5]), ("s2.safetensors", names[5:])):
        write_safetensors(os.path.join(folder, shard), {n: tensors[n] for n in part})
        weight_map.update({n: shard for n in part})
    if entry_of is not None:
        weight_map[names[0]] = entry_of(names[0], weight_map[names[0]])
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return index, names[0]


def _write_raw(path: str, entries: dict) -> None:
    """A safetensors file by hand (name -> (header dtype, shape)), zero data: the dtypes
    numpy cannot write, such as FP8."""
    header, offset = {}, 0
    for name, (dtype, shape) in entries.items():
        size = int(np.prod(shape)) * DTYPE_BYTES.get(dtype, 4)
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + bytes(offset))


def _retype(folder: str, name: str, dtype: str) -> None:
    """Rewrites model.safetensors with tensor `name` stored as `dtype` (the others F32)."""
    path = os.path.join(folder, "model.safetensors")
    shapes = {n: a.shape for n, a in read_safetensors(path).items()}
    _write_raw(path, {n: (dtype if n == name else "F32", s) for n, s in shapes.items()})


@pytest.fixture
def forbid_reads(monkeypatch):
    """forbid_reads() makes reading any tensor's data an error from then on: the checks that
    follow must come from the headers."""
    def refuse(self, name):
        raise AssertionError(f"tensor {name!r} was read")
    return lambda: monkeypatch.setattr(SafetensorsFile, "__getitem__", refuse)


# ----------------------------------------------------------------------------- the index
@pytest.mark.parametrize("entry", ["/etc/passwd", "../outside.safetensors",
                                   "sub/../s1.safetensors", "/dev/zero"])
def test_index_entries_leaving_the_folder_are_refused(folder, entry):
    index, name = _shard(folder, lambda n, shard: entry)
    with pytest.raises(ValueError) as error:
        load(folder)
    message = str(error.value)
    assert message.startswith(f"{index}: weight_map[{name!r}]={entry!r} leaves the "
                              f"checkpoint folder"), message
    assert "allowed: a file name relative to the folder" in message


@pytest.mark.parametrize("entry", [5, None, ["s1.safetensors"], ""])
def test_index_entries_that_are_not_file_names_are_refused(folder, entry):
    index, name = _shard(folder, lambda n, shard: entry)
    with pytest.raises(ValueError, match=rf"^{index}: weight_map\['{name}'\]=.*allowed: a "
                                         rf"file name"):
        load(folder)


def test_index_entries_inside_the_folder_load(saved, folder):
    os.makedirs(os.path.join(folder, "sub"))
    index, _ = _shard(folder)
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    os.rename(os.path.join(folder, "s2.safetensors"), os.path.join(folder, "sub", "s2"))
    weight_map = {n: "./s1.safetensors" if s == "s1.safetensors" else "sub//s2"
                  for n, s in weight_map.items()}
    with open(index, "w") as f:
        json.dump({"weight_map": weight_map}, f)
    params = load_hf_checkpoint(folder)[1]
    np.testing.assert_array_equal(params["embed"], saved[0]["embed"])


def test_a_shard_that_is_not_a_regular_file_is_not_called_missing(folder):
    _shard(folder)
    shard = os.path.join(folder, "s2.safetensors")
    os.remove(shard)
    os.mkdir(shard)
    with pytest.raises(ValueError, match=rf"^{shard}: not a regular file"):
        load(folder)
    os.rmdir(shard)
    os.symlink("/dev/zero", shard)
    with pytest.raises(ValueError, match=rf"^{shard}: not a regular file"):
        load(folder)


def test_a_config_json_that_is_not_a_regular_file_is_named(folder):
    path = os.path.join(folder, "config.json")
    os.remove(path)
    os.mkdir(path)
    with pytest.raises(ValueError, match=rf"^{path}: not a regular file"):
        load(folder)


def test_hf_hub_cache_layout_with_symlinks_into_blobs_loads(saved, tmp_path):
    """snapshots/<rev>/<file> -> ../../blobs/<hash>, as huggingface_hub stores downloads."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "0123abcd"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(saved[1]))):
        shutil.copy(os.path.join(saved[1], name), blobs / f"hash{i}")
        os.symlink(f"../../blobs/hash{i}", snapshot / name)
    model, params, _ = load(str(snapshot))
    assert model == Llama(LlamaConfig(**SMALL))
    np.testing.assert_array_equal(params["layers"]["wq"], saved[0]["layers"]["wq"])


# ----------------------------------------------------------------------------- tensor dtypes
@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2"])
def test_fp8_tensors_are_refused_from_the_header(folder, dtype, forbid_reads):
    _retype(folder, Q_PROJ, dtype)
    path = os.path.join(folder, "model.safetensors")
    forbid_reads()
    with pytest.raises(ValueError, match=rf"^{path}: tensor '{Q_PROJ}' is {dtype}: FP8 .*not "
                                         rf"supported.*allowed: F32, F16, BF16, F64"):
        load(folder)


def test_reading_an_fp8_tensor_directly_is_a_value_error(folder):
    _retype(folder, Q_PROJ, "F8_E4M3")
    with pytest.raises(ValueError, match=rf"tensor '{Q_PROJ}' is F8_E4M3"):
        read_safetensors(os.path.join(folder, "model.safetensors"))


@pytest.mark.parametrize("dtype", ["I8", "BOOL", "I32", "U64", "C64"])
def test_tensors_that_are_not_floating_point_are_refused(folder, dtype, forbid_reads):
    _retype(folder, Q_PROJ, dtype)
    path = os.path.join(folder, "model.safetensors")
    forbid_reads()
    with pytest.raises(ValueError, match=rf"^{path}: tensor '{Q_PROJ}' is {dtype}; allowed: "
                                         rf"F32, F16, BF16, F64 \(floating-point weights\)"):
        load(folder)


def test_a_non_float_tensor_in_a_shard_names_its_shard(folder, forbid_reads):
    _shard(folder)
    shard = os.path.join(folder, "s1.safetensors")
    stored = SafetensorsFile(shard)
    name, shapes = sorted(stored)[0], {n: stored.shape(n) for n in stored}
    _write_raw(shard, {n: ("I8" if n == name else "F32", s) for n, s in shapes.items()})
    forbid_reads()
    with pytest.raises(ValueError, match=rf"^{shard}: tensor '{name}' is I8"):
        load(folder)


@pytest.mark.parametrize("dtype", ["F16", "F64"])
def test_other_float_dtypes_load(folder, dtype):
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    tensors[Q_PROJ] = tensors[Q_PROJ].astype(np.float16 if dtype == "F16" else np.float64)
    write_safetensors(path, tensors)
    assert load(folder)[1]["layers"]["wq"].dtype == np.float32


def test_cli_maps_a_refused_tensor_dtype_to_the_model_exit_status(folder):
    from jaxgen.cli.errors import EXIT_MODEL, CliError
    from jaxgen.cli.main import load_model

    _retype(folder, Q_PROJ, "F8_E4M3")
    args = SimpleNamespace(model=folder, dtype="float32", no_cache=True, weights="float")
    with pytest.raises(CliError, match=r"F8_E4M3") as error:
        load_model(args)
    assert error.value.code == EXIT_MODEL


# ----------------------------------------------------------------------------- the MTP drafter
def test_drafter_tensor_dtypes_and_shapes_are_checked_from_the_header(drafter_folder,
                                                                   forbid_reads):
    path = os.path.join(drafter_folder, "model.safetensors")
    shapes = {n: SafetensorsFile(path).shape(n) for n in SafetensorsFile(path)}
    forbid_reads()
    _write_raw(path, {n: ("I32" if n == "norm.weight" else "F32", s) for n, s in shapes.items()})
    with pytest.raises(ValueError, match=rf"^{path}: tensor 'norm.weight' is I32; allowed"):
        load(drafter_folder)
    _write_raw(path, {**{n: ("F32", s) for n, s in shapes.items()}, "norm.weight": ("F32", (3,))})
    with pytest.raises(ValueError, match=rf"^{path}: tensor 'norm.weight' has shape \(3,\)"):
        load(drafter_folder)


# ----------------------------------------------------------------------------- JSON files
CONFIG_READERS = {"llama": load_hf_config, "glm4_moe": load_glm4_moe_config,
                  "deepseek_v3": load_deepseek_v3_config, "gemma2": load_gemma_config,
                  "gemma4_text": read_gemma4_config, "gemma4_assistant": load_gemma4_assistant,
                  "drafter": load_mtp_drafter, "load": load}
BAD_JSON = {"not UTF-8 text": b'{"model_type": "llama\xff"}',
            r"invalid JSON \(nested too deeply\)": b"[" * 100000 + b"]" * 100000}


@pytest.mark.parametrize("reader", sorted(CONFIG_READERS))
@pytest.mark.parametrize("problem", sorted(BAD_JSON))
def test_a_bad_config_json_is_a_value_error_naming_it(tmp_path, reader, problem):
    path = tmp_path / "config.json"
    path.write_bytes(BAD_JSON[problem])
    with pytest.raises(ValueError, match=rf"^{path}: {problem}"):
        CONFIG_READERS[reader](str(tmp_path))


def test_a_bad_index_json_is_a_value_error_naming_it(folder):
    index, _ = _shard(folder)
    with open(index, "wb") as f:
        f.write(b'{"weight_map": {"a": "s1.safetensors\xff"}}')
    with pytest.raises(ValueError, match=rf"^{index}: not UTF-8 text"):
        load(folder)


def test_a_malformed_tokenizer_file_fails_before_any_weight_is_read(folder, forbid_reads):
    from jaxgen.models import tiny_tokenizer

    tiny_tokenizer().backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"additional_special_tokens": "<extra>"}, f)  # a string, not a list
    forbid_reads()
    with pytest.raises(ValueError, match="tokenizer_config.json.*additional_special_tokens"):
        load(folder)


def test_an_oversized_json_file_is_refused_unread(folder, monkeypatch):
    from jaxgen.models import checkpoint_files

    monkeypatch.setattr(checkpoint_files, "MAX_JSON_BYTES", 64)
    path = os.path.join(folder, "config.json")
    with pytest.raises(ValueError, match=rf"^{path}: [\d,]+ bytes, past the 64 a checkpoint's "
                                         r"JSON or text file may hold"):
        load(folder)
