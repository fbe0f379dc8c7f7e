"""`load()`'s own arguments are checked before anything is read: dtype= (float32 or
bfloat16, any spelling), name_or_path (a str or path-like), group= (names the matrix)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxgen.models import Llama, LlamaConfig, load
from jaxgen.models.hf_export import save_hf_checkpoint
from jaxgen.models.checkpoint_checks import check_load_dtype
from jaxgen.models.deepseek_checkpoint import load_deepseek_v3
from jaxgen.models.gemma4_assistant import load_gemma4_assistant
from jaxgen.models.gemma4_checkpoint import load_gemma4
from jaxgen.models.gemma_checkpoint import load_gemma_checkpoint
from jaxgen.models.gguf_checkpoint import load_gguf_checkpoint
from jaxgen.models.glm4_checkpoint import load_glm4_moe
from jaxgen.models.hf_checkpoint import load_hf, load_hf_checkpoint
from jaxgen.models.mtp_drafter_io import load_mtp_drafter

SMALL = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=4, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    model = Llama(LlamaConfig(**SMALL))
    return save_hf_checkpoint(model, model.init_params(jax.random.key(1)),
                              str(tmp_path_factory.mktemp("hf")))


@pytest.mark.parametrize("dtype", ["int8", jnp.int32, bool, "foo", 5, None, np.float64,
                                   "float16", "float8_e4m3fn"])
def test_a_dtype_other_than_float32_or_bfloat16_is_refused_before_reading(dtype):
    with pytest.raises(ValueError, match=r"^dtype=.* is not supported; allowed: float32, "
                                         r"bfloat16$"):
        load("no/such/folder", dtype)  # the dtype is refused before the path is looked at


@pytest.mark.parametrize("loader", [load_hf, load_hf_checkpoint, load_gemma_checkpoint,
                                    load_gemma4, load_gemma4_assistant, load_glm4_moe,
                                    load_deepseek_v3, load_gguf_checkpoint, load_mtp_drafter])
def test_each_family_loader_refuses_another_dtype_before_reading(loader, folder):
    with pytest.raises(ValueError, match=r"^dtype='int8' is not supported; allowed: float32"):
        loader(folder, "int8")  # a Llama folder: each would fail later on it, not first
    with pytest.raises(ValueError, match=r"^dtype=<class 'jax.numpy.int32'> is not supported"):
        loader("no/such/folder", jnp.int32)


@pytest.mark.parametrize("dtype, name", [(jnp.float32, "float32"), (np.float32, "float32"),
                                         ("float32", "float32"), (jnp.bfloat16, "bfloat16"),
                                         (ml_dtypes.bfloat16, "bfloat16"),
                                         ("bfloat16", "bfloat16"),
                                         (np.dtype("float32"), "float32")])
def test_every_spelling_of_the_allowed_dtypes_loads(folder, dtype, name):
    assert check_load_dtype(dtype) == jnp.dtype(name)
    assert load(folder, dtype)[1]["layers"]["wq"].dtype == jnp.dtype(name)


def test_a_bytes_path_is_a_type_error_naming_the_argument(folder):
    with pytest.raises(TypeError, match=r"^name_or_path=b'.*' is a bytes; allowed: a str or "
                                        r"os\.PathLike"):
        load(folder.encode())


def test_int8_group_that_does_not_divide_names_the_matrix(folder):
    with pytest.raises(ValueError, match=r"group=16 must divide the matrix's input size: "
                                         r"layers\.w_down has 24 inputs"):
        load(folder, weights="int8", group=16)
