"""GGUF blocks kept as integers (`load(path, weights="gguf")`, jaxgen/models/gguf_blocks.py): the
blocks expand to exactly the float loader's weights, logits and greedy tokens agree with
`weights="float"`, both layer layouts run them, and bad input is refused before compile."""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgen
from jaxgen.models import load, unstack_layers
from jaxgen.models.gguf_blocks import BlockMatrix
from tests.test_loader_checks import small_model, write_gguf

Q = gguf.GGMLQuantizationType
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def quantized_file(tmp_path, kind, *, tied=True, head_kind=None, layers_kind=None):
    """A 2-layer Llama GGUF (inputs multiples of 32) with every matrix stored as `kind`."""
    model = small_model(vocab_size=48, hidden_size=32, intermediate_size=64, head_dim=8,
                        tie_word_embeddings=tied)
    params = model.init_params(jax.random.key(7))
    names = [f"blk.{i}.{m}.weight" for i in range(2) for m in MATRICES]
    quant = {name: kind for name in names}
    if layers_kind is not None:  # layer 1 of every matrix gets another type
        quant.update({f"blk.1.{m}.weight": layers_kind for m in MATRICES})
    quant["token_embd.weight" if tied else "output.weight"] = head_kind or kind
    path = str(tmp_path / f"{kind.name}.gguf")
    return write_gguf(path, model, params, quant=quant)


def expanded(params):
    """params with every BlockMatrix replaced by the float matrix it stands for."""
    return jax.tree_util.tree_map(lambda m: m.dequantize() if isinstance(m, BlockMatrix) else m,
                                  params, is_leaf=lambda m: isinstance(m, BlockMatrix))


@pytest.mark.parametrize("kind, tied", [(Q.Q4_0, True), (Q.Q4_1, False), (Q.Q8_0, True)],
                         ids=["Q4_0-tied", "Q4_1-untied", "Q8_0-tied"])
def test_blocks_expand_to_the_float_weights_and_decode_the_same(tmp_path, kind, tied):
    path = quantized_file(tmp_path, kind, tied=tied)
    model, float_params, _ = load(path)
    block_model, blocks, _ = load(path, weights="gguf")
    assert block_model == model
    wq, head = blocks["layers"]["wq"], blocks["lm_head"]
    assert isinstance(wq, BlockMatrix) and wq.kind == kind.name and wq.shape == (2, 32, 32)
    assert isinstance(head, BlockMatrix) and head.shape == (32, 48)
    model.check_params(blocks)
    weights = sum(float_params["layers"][k].size for k in blocks["layers"]
                  if isinstance(blocks["layers"][k], BlockMatrix))
    block_bytes = sum(m.nbytes for m in blocks["layers"].values() if isinstance(m, BlockMatrix))
    assert block_bytes * 8 / weights == {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5}[kind.name]
    # The blocks stand for the float loader's values exactly (q/k rows back in HF order).
    exact = expanded(blocks)
    for key, value in float_params["layers"].items():
        np.testing.assert_array_equal(np.asarray(exact["layers"][key]), np.asarray(value))
    reference_head = float_params["embed"].T if tied else float_params["lm_head"]
    np.testing.assert_array_equal(np.asarray(exact["lm_head"]), np.asarray(reference_head))
    # Same logits to float rounding.
    tokens, positions = jnp.array([[3, 1, 4, 1, 5]]), jnp.arange(5)[None]  # [1, 5]
    ref = model(float_params, tokens, positions, model.init_cache(1, 5)).logits
    got = model(blocks, tokens, positions, model.init_cache(1, 5)).logits
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_generate_with_blocks_gives_the_float_tokens_in_both_layouts(tmp_path):
    """Greedy tokens equal the float load's, stacked scan and per-layer weights (Q4_1, untied:
    the other kinds differ only in the expansion checked above)."""
    path = quantized_file(tmp_path, Q.Q4_1, tied=False)
    model, float_params, _ = load(path)
    _, blocks, _ = load(path, weights="gguf")
    cfg = jaxgen.GenerationConfig(max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6]]
    want = jaxgen.generate(float_params, jaxgen.init_state(model, prompts, cfg), cfg).sequences
    for p in (blocks, unstack_layers(model, blocks)):
        out = jaxgen.generate(p, jaxgen.init_state(model, prompts, cfg), cfg).sequences
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_mixed_head_and_layer_kinds_load(tmp_path):
    """llama.cpp files often keep the embeddings at Q8_0 and the layers at Q4_1."""
    path = quantized_file(tmp_path, Q.Q4_1, head_kind=Q.Q8_0)
    _, blocks, _ = load(path, weights="gguf")
    assert blocks["layers"]["w_up"].kind == "Q4_1" and blocks["lm_head"].kind == "Q8_0"
    assert blocks["embed"].dtype == jnp.float32  # the token lookup stays float


def test_bad_input_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"tensor blk\.0\.attn_q\.weight is Q5_0; "
                                         r"weights='gguf' keeps Q4_0, Q4_1, Q8_0 blocks"):
        load(quantized_file(tmp_path, Q.Q5_0), weights="gguf")
    mixed = quantized_file(tmp_path, Q.Q4_0, layers_kind=Q.Q8_0)
    with pytest.raises(ValueError, match=r"mix GGUF block types \['Q4_0', 'Q8_0'\]"):
        load(mixed, weights="gguf")
    with pytest.raises(ValueError, match=r"weights='gguf' keeps a GGUF file's blocks; "
                                         r"'tiny-llama' is not a \.gguf file"):
        load("tiny-llama", weights="gguf")
    with pytest.raises(ValueError, match=r"allowed: 'float', 'int8', 'gguf'"):
        load(str(tmp_path / "x.gguf"), weights="q4")


def test_head_of_another_type_stays_float_and_no_tokenizer_caches(tmp_path):
    """llama-quantize stores the head of a Q4_0 file as Q6_K: it keeps the float load (here
    Q5_0 stands in). The file has no tokenizer metadata: tokenizer None, also from cache_dir."""
    path = quantized_file(tmp_path, Q.Q4_0, head_kind=Q.Q5_0)
    for _ in range(2):  # the entry is built, then read back
        _, blocks, tokenizer = load(path, weights="gguf", cache_dir=str(tmp_path / "cache"))
        assert tokenizer is None
    assert isinstance(blocks["layers"]["wq"], BlockMatrix) and "lm_head" not in blocks


def test_draft_vocab_reads_a_quantized_head(tmp_path):
    """A pruned draft vocabulary on the blocks: the gathered head columns give the float
    load's draft logits, with_draft_head copies exactly the float load's head rows."""
    from jaxgen.models.draft_vocab import (
        DraftVocabModel,
        restricted_logits,
        with_draft_head,
    )

    path = quantized_file(tmp_path, Q.Q8_0, tied=False)
    model, float_params, _ = load(path)
    blocks = load(path, weights="gguf")[1]
    vocab = tuple(range(0, 48, 3))
    hidden = jax.random.normal(jax.random.key(1), (1, 2, 32))  # [B, S, D]
    np.testing.assert_allclose(restricted_logits(model, blocks, hidden, vocab),
                               restricted_logits(model, float_params, hidden, vocab),
                               rtol=1e-5, atol=1e-5)  # [B, S, V_d]
    draft = DraftVocabModel(model, vocab)
    np.testing.assert_array_equal(np.asarray(with_draft_head(draft, blocks)["draft_head"]),
                                  np.asarray(with_draft_head(draft, float_params)["draft_head"]))


def test_hf_export_writes_the_float_values(tmp_path):
    from jaxgen.models.hf_export import to_hf_arrays

    path = quantized_file(tmp_path, Q.Q4_1, tied=False, head_kind=Q.Q8_0)
    model, float_params, _ = load(path)
    blocks = load(path, weights="gguf")[1]
    want, got = to_hf_arrays(model, float_params), to_hf_arrays(model, blocks)
    assert got.keys() == want.keys()
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)


@pytest.mark.slow
def test_smollm2_gguf_blocks_decode_like_the_float_load():
    """The embedded SmolLM2 file (Q4_1 layers, Q8_0 embeddings): 66 MB of layer blocks in
    place of 425 MB of float32, the same greedy answers."""
    model, params, tok = load("smollm2-135m-instruct")
    _, blocks, _ = load("smollm2-135m-instruct", weights="gguf")
    layer_bytes = sum(m.nbytes for m in blocks["layers"].values() if isinstance(m, BlockMatrix))
    assert layer_bytes == 5 / 32 * sum(params["layers"][k].nbytes for k in blocks["layers"]
                                       if isinstance(blocks["layers"][k], BlockMatrix))
    ids = [tok.apply_chat_template([{"role": "user", "content": text}]) for text in
           ("What is the capital of France?", "Name three colours.")]
    cfg = jaxgen.GenerationConfig(max_new_tokens=24)
    want = jaxgen.generate(params, jaxgen.init_state(model, ids, cfg), cfg).sequences
    got = jaxgen.generate(blocks, jaxgen.init_state(model, ids, cfg), cfg).sequences
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
