"""Where a checkpoint's multi-token-prediction (MTP) layers live: the params layout and the
Hugging Face tensor names (DeepSeek-V3 / GLM-4.5 naming, what transformers' `MtpModel` loads).

Depth k (0 <= k < D = config.num_mtp_layers) is stored in the HF checkpoint as layer index
N = num_hidden_layers + k:

    model.layers.{N}.enorm.weight               [H]       -> params["mtp"]["enorm"][k]
    model.layers.{N}.hnorm.weight               [H]       -> params["mtp"]["hnorm"][k]
    model.layers.{N}.eh_proj.weight             [H, 2H]   -> params["mtp"]["eh_proj"][k]  [2H, H]
    model.layers.{N}.shared_head.norm.weight    [H]       -> params["mtp"]["norm"][k]
    model.layers.{N}.<decoder block names>                -> params["mtp"]["layers"][key][k]
    model.layers.{N}.shared_head.head.weight, model.layers.{N}.embed_tokens.weight
                                                          copies of the shared LM head /
                                                          embeddings: accepted, not loaded

(transformers renames `shared_head.norm` to its `post_norm`; the block keeps the model's own
names: input_layernorm, self_attn.q_proj, ..., mlp.down_proj.)

Example:
    >>> from jaxgen.models import LlamaConfig
    >>> from jaxgen.models.llama import param_shapes
    >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
    ...                      num_heads=2, num_kv_heads=1, head_dim=8, num_mtp_layers=1)
    >>> shapes = mtp_shapes(config, param_shapes(config)["layers"])
    >>> shapes["eh_proj"], shapes["layers"]["wk"]
    ((1, 32, 16), (1, 16, 8))
    >>> hf_mtp_names(config, 0)["eh_proj"]
    ('model.layers.2.eh_proj.weight', True)
"""
from __future__ import annotations

MTP_NAMES = {  # params["mtp"] key -> (HF suffix under model.layers.{N}., transposed)
    "enorm": ("enorm.weight", False),
    "hnorm": ("hnorm.weight", False),
    "eh_proj": ("eh_proj.weight", True),
    "norm": ("shared_head.norm.weight", False),
}
# Copies of the shared embeddings / LM head some checkpoints store per depth (HF ignores them).
MTP_SHARED_COPIES = ("shared_head.head.weight", "embed_tokens.weight")


def mtp_shapes(config, layer_shapes: dict) -> dict:
    """params["mtp"]'s shapes: every entry stacked over the D depths (leading axis D).

    layer_shapes: the model's stacked decoder-layer shapes {key: (L, ...)} (llama.param_shapes);
    the MTP blocks have the same keys with D in place of L.
    """
    depths, hidden = config.num_mtp_layers, config.hidden_size
    return {"enorm": (depths, hidden), "hnorm": (depths, hidden),
            "eh_proj": (depths, 2 * hidden, hidden), "norm": (depths, hidden),
            "layers": {key: (depths, *shape[1:]) for key, shape in layer_shapes.items()}}


def hf_mtp_names(config, depth: int) -> dict:
    """{params["mtp"] key: (HF tensor name, transposed)} of depth `depth`'s own tensors (the
    decoder block's names come from the model's layer table)."""
    index = config.num_layers + depth
    return {key: (f"model.layers.{index}.{suffix}", transpose)
            for key, (suffix, transpose) in MTP_NAMES.items()}
