"""Gemma 4's assistant (HF's Gemma4AssistantForCausalLM, model_type "gemma4_assistant") as an
MTP drafter for a Gemma 4 target: `assistant_model=(assistant, params)` drafts through
jaxgen/speculative/drafters/mtp_assistant.py (this model is recognised by `drafts_from_target`).

One draft step, as transformers' SinglePositionMultiTokenCandidateGenerator runs it (P = L - 1,
the position of the row's newest token t; every step of a round queries at P):

    x      = [target.embed(t) ; h] @ pre_projection        h: the target's final-normed hidden
                                                           state that predicted t, from the
                                                           second step on the assistant's g
    layer  x += norm(attention(norm(x)))   queries only (q_norm, RoPE at P); keys / values are
                                           the target's cached K/V of the last non-shared target
                                           layer of the same type (scale 1)
           x += norm(gelu_mlp(norm(x)));  x *= layer_scalar
    n      = norm(x);  g = n @ post_projection;  logits = n @ lm_head (tied to the assistant's
             own embeddings; with use_ordered_embeddings only the tokens of the top centroids,
             the rest at min - 1)

Which target keys a step sees follows transformers exactly (its `shared_kv_states` are the
target's K/V arrays of the last forward, cut to the current length): full layers see positions
[0, min(E, L)), where E is the end of the target's last forward, so after a rejected draft the
key at P is the first rejected draft's; sliding layers see the last `sliding_window + 1` entries
of the target's sliding array [max(0, L0 - W_target), E) cut to L entries (L0: the length when
the last verify began). The drafter keeps (L0, drafts) per row as its state for this.

Params layout (N layers, D the assistant's width, Dt the target's, V vocabulary):

    embed            [V, D]          (its lm_head when tied)
    lm_head          [D, V]          (only when tie_word_embeddings is False)
    pre_projection   [2 Dt, D]
    post_projection  [D, Dt]
    final_norm       [D]
    layers[i]        attn_norm, wq, q_norm, wo, post_attn_norm, mlp_norm, w_gate, w_up, w_down,
                     post_mlp_norm, layer_scalar (as jaxgen.models.gemma4, without K / V)
    centroids        [D, C]          (use_ordered_embeddings)
    token_ordering   [V] int32       (use_ordered_embeddings)

Example:
    >>> from jaxgen.models.gemma4 import Gemma4, Gemma4Config
    >>> shapes = dict(vocab_size=32, intermediate_size=32, num_heads=2,
    ...               layer_types=("sliding_attention", "full_attention"), head_dims=(4, 8),
    ...               kv_heads=(1, 1), sliding_window=4)
    >>> target = Gemma4(Gemma4Config(hidden_size=16, **shapes))
    >>> assistant = Gemma4Assistant(Gemma4AssistantConfig(
    ...     text=Gemma4Config(hidden_size=8, **shapes), backbone_hidden_size=16))
    >>> assistant.check_target(target)
    >>> assistant.param_shapes()["pre_projection"]
    (32, 8)
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.attention import KeyBlock, attend_blocks
from jaxgen.cache.sharding import MODEL, check_divides
from jaxgen.models.checkpoint_checks import check_load_dtype
from jaxgen.models.checkpoint_files import read_json_object
from jaxgen.models.config_checks import check_int
from jaxgen.models.gemma4 import (
    Gemma4,
    Gemma4Config,
    _check_tree,
    apply_rope,
    gelu_tanh,
    gemma4_norm,
    rope_cos_sin,
)
from jaxgen.models.gemma4_checkpoint import gemma4_config, gemma4_params, read_lm_head
from jaxgen.models.hf_checkpoint import read_hf_tensors

MODEL_TYPE = "gemma4_assistant"

__all__ = ["Gemma4Assistant", "Gemma4AssistantConfig", "MODEL_TYPE", "load_gemma4_assistant"]


@dataclasses.dataclass(frozen=True)
class Gemma4AssistantConfig:
    """The assistant's own text config (its layers; no PLE, no K/V) and what it reads."""

    text: Gemma4Config
    backbone_hidden_size: int  # Dt, the target's hidden size
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32

    def __post_init__(self):
        if self.text.hidden_size_per_layer_input:
            raise ValueError("the assistant's hidden_size_per_layer_input must be 0")
        if self.use_ordered_embeddings and self.text.vocab_size % self.num_centroids:
            raise ValueError(f"num_centroids={self.num_centroids} must divide vocab_size="
                             f"{self.text.vocab_size}")

    @property
    def vocab_size(self) -> int:  # what jaxgen.models.shard reads for the vocabulary split
        return self.text.vocab_size


class RoundContext(NamedTuple):
    """What every step of one round reads: the target's cache and, per row, the visible
    key ranges [lo, hi) of the full and the sliding shared K/V."""

    cache: Any
    full: tuple  # (lo [B], hi [B])
    sliding: tuple  # (lo [B], hi [B])


@dataclasses.dataclass(frozen=True)
class Gemma4Assistant:
    """Gemma 4's assistant: hashable, drafts from a Gemma 4 target's state."""

    config: Gemma4AssistantConfig
    drafts_from_target = True  # jaxgen.speculative.drafters.mtp_assistant

    @property
    def vocab_size(self) -> int:
        return self.config.text.vocab_size

    def check_mesh_fits(self, mesh) -> None:
        """ValueError naming the text_config size the mesh's "model" axis does not divide
        (the heads, the MLP width). On a mesh (jaxgen.models.shard) the layers split as the
        Llama rules say, the embeddings by vocabulary where it divides; the projections and
        the centroids stay whole."""
        text = self.config.text
        hint = "choose a model axis that divides it (the data axis may take the other devices)"
        check_divides("text_config.num_attention_heads", text.num_heads, mesh, MODEL, hint)
        check_divides("text_config.intermediate_size", text.intermediate_size, mesh, MODEL,
                      hint)

    def param_shapes(self) -> dict:
        text = self.config.text
        D, H, Dt = text.hidden_size, text.num_heads, self.config.backbone_hidden_size
        layers = []
        for i in range(text.num_layers):
            dh, F = text.head_dims[i], text.intermediate_size
            layers.append({"attn_norm": (D,), "wq": (D, H * dh), "q_norm": (dh,),
                           "wo": (H * dh, D), "post_attn_norm": (D,), "mlp_norm": (D,),
                           "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D),
                           "post_mlp_norm": (D,), "layer_scalar": (1,)})
        shapes = {"embed": (text.vocab_size, D), "final_norm": (D,), "layers": layers,
                  "pre_projection": (2 * Dt, D), "post_projection": (D, Dt)}
        if not text.tie_word_embeddings:
            shapes["lm_head"] = (D, text.vocab_size)
        if self.config.use_ordered_embeddings:
            shapes.update(centroids=(D, self.config.num_centroids),
                          token_ordering=(text.vocab_size,))
        return shapes

    def init_params(self, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
        """Random parameters (normal * scale; norms and scalars at 1; a random ordering)."""
        shapes = self.param_shapes()
        order = shapes.pop("token_ordering", None)
        flat, treedef = jax.tree_util.tree_flatten(shapes,
                                                   is_leaf=lambda s: isinstance(s, tuple))
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
        keys = jax.random.split(key, len(flat) + 1)
        values = [jnp.ones(s, dtype) if "norm" in p or "scalar" in p
                  else (scale * jax.random.normal(k, s)).astype(dtype)
                  for k, s, p in zip(keys, flat, paths)]
        params = jax.tree_util.tree_unflatten(treedef, values)
        if order is not None:
            params["token_ordering"] = jax.random.permutation(keys[-1], order[0]).astype(
                jnp.int32)
        return params

    def check_params(self, params: Any) -> None:
        """ValueError naming the first parameter that does not fit."""
        if not isinstance(params, Mapping):
            raise ValueError(f"params is a {type(params).__name__}, expected a dict")
        _check_tree(params, self.param_shapes(), {}, "assistant params")

    def check_target(self, target: Any) -> None:
        """ValueError when the target is not a Gemma 4 model this assistant fits."""
        if not hasattr(getattr(target, "config", None), "producers"):  # a Gemma 4 model
            raise ValueError(f"a Gemma 4 assistant drafts for a Gemma 4 target (jaxgen.models."
                             f"gemma4.Gemma4), got {type(target).__name__}")
        text, tcfg = self.config.text, target.config
        if self.config.backbone_hidden_size != tcfg.hidden_size:
            raise ValueError(f"the assistant's backbone_hidden_size="
                             f"{self.config.backbone_hidden_size}, but the target's hidden_size="
                             f"{tcfg.hidden_size}")
        if text.vocab_size != tcfg.vocab_size:
            raise ValueError(f"the assistant's vocab_size={text.vocab_size}, but the target's "
                             f"vocab_size={tcfg.vocab_size}")
        for kind in ("sliding_attention", "full_attention"):
            if kind not in tcfg.layer_types[:tcfg.first_shared]:
                raise ValueError(f"the target has no {kind} layer to share K/V with the "
                                 f"assistant")
        for i, kind in enumerate(text.layer_types):
            head_dim, heads = tcfg.type_shape(kind)
            if text.head_dims[i] != head_dim or text.num_heads % heads:
                raise ValueError(f"assistant layer {i} ({kind}): head_dim={text.head_dims[i]}, "
                                 f"num_attention_heads={text.num_heads}; the target's {kind} "
                                 f"K/V have head_dim={head_dim}, {heads} kv heads")

    # ------------------------------------------------------------------ drafting hooks
    def init_draft_state(self, state) -> dict:
        """After the prefill (row length P + 1): the last forward covered [0, P)."""
        prompt = state.length - 1  # [B]
        return {"start": jnp.zeros_like(prompt), "drafts": prompt}

    def after_propose(self, draft_state, state, k_row) -> dict:
        """The round's verify forward will cover [L - 1, L + k_row)."""
        return {"start": state.length, "drafts": k_row.astype(jnp.int32)}

    def round_inputs(self, params, target, target_params, hidden, state, draft_state):
        """(the target's final-normed hidden [B, Dt], RoundContext) for one round."""
        normed = gemma4_norm(hidden, target_params["final_norm"], target.config.rms_norm_eps)
        length = state.length  # [B]
        start, drafts = draft_state["start"], draft_state["drafts"]
        end = start + drafts  # [B] end of the target's last forward
        full = (jnp.zeros_like(length), jnp.minimum(end, length))
        lo = jnp.maximum(start - target.config.sliding_window, 0)  # [B]
        hi = jnp.minimum(lo + length, end)  # [B]
        sliding = (jnp.maximum(lo, hi - (self.config.text.sliding_window + 1)), hi)
        return normed, RoundContext(cache=state.cache, full=full, sliding=sliding)

    def step(self, params, target, target_params, token, hidden, position, context):
        """One draft step: token [B], hidden [B, Dt], position [B] -> (logits [B, V] f32,
        next hidden [B, Dt])."""
        text = self.config.text
        eps = text.rms_norm_eps
        embedded = target.embed(target_params, token[:, None])  # [B, 1, Dt]
        x = jnp.concatenate([embedded, hidden[:, None].astype(embedded.dtype)],
                            axis=-1) @ params["pre_projection"]  # [B, 1, D]
        positions = position[:, None]  # [B, 1]
        for i, p in enumerate(params["layers"]):
            kind = text.layer_types[i]
            x = self._block(p, i, x, positions, kind, target, context)
        normed = gemma4_norm(x, params["final_norm"], eps)[:, 0]  # [B, D]
        logits = self._logits(params, normed)  # [B, V]
        return logits, normed @ params["post_projection"]  # [B, V], [B, Dt]

    def _block(self, p, index, x, positions, kind, target, context):
        text = self.config.text
        eps = text.rms_norm_eps
        batch = x.shape[0]
        dh = text.head_dims[index]
        cos, sin = rope_cos_sin(positions, dh, text.rope_dict[kind], x.dtype)
        h = gemma4_norm(x, p["attn_norm"], eps)  # [B, 1, D]
        q = (h @ p["wq"]).reshape(batch, 1, text.num_heads, dh)  # [B, 1, H, Dh]
        q = apply_rope(gemma4_norm(q, p["q_norm"], eps), cos, sin)
        producer = max(i for i in range(target.config.first_shared)
                       if target.config.layer_types[i] == kind)
        k, v = context.cache.layer_kv(producer)  # [B, Hkv, T, Dh] each
        lo, hi = context.full if kind == "full_attention" else context.sliding
        slots = jnp.arange(k.shape[2], dtype=jnp.int32)  # [T]
        valid = (slots[None] >= lo[:, None]) & (slots[None] < hi[:, None])  # [B, T]
        block = KeyBlock(k=k, v=v.astype(k.dtype), positions=slots, valid=valid)
        top = jnp.full((batch, 1), k.shape[2], jnp.int32)  # every slot is "in the past"
        attn = attend_blocks(q.astype(k.dtype), top, [block], scale=1.0).astype(x.dtype)
        out = attn.reshape(batch, 1, text.num_heads * dh) @ p["wo"]  # [B, 1, D]
        x = x + gemma4_norm(out, p["post_attn_norm"], eps)
        h = gemma4_norm(x, p["mlp_norm"], eps)
        mlp = (gelu_tanh(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]  # [B, 1, D]
        x = x + gemma4_norm(mlp, p["post_mlp_norm"], eps)
        return x * p["layer_scalar"].astype(x.dtype)  # [B, 1, D]

    def _logits(self, params, normed):
        """normed [B, D] -> [B, V] f32: the head, or HF's masked embedder (top centroids'
        tokens keep their logits, the others get the row's lowest kept logit - 1)."""
        head = params.get("lm_head")
        logits = (normed @ params["embed"].T if head is None
                  else normed @ head).astype(jnp.float32)  # [B, V]
        if not self.config.use_ordered_embeddings:
            return logits
        cfg = self.config
        vocab = cfg.text.vocab_size
        per_cluster = vocab // cfg.num_centroids
        scores = normed @ params["centroids"]  # [B, C]
        _, top = jax.lax.top_k(scores, cfg.centroid_intermediate_top_k)  # [B, k]
        chosen = jnp.zeros(scores.shape, bool).at[jnp.arange(scores.shape[0])[:, None],
                                                  top].set(True)  # [B, C]
        cluster = jnp.zeros((vocab,), jnp.int32).at[params["token_ordering"]].set(
            jnp.arange(vocab, dtype=jnp.int32) // per_cluster)  # [V]
        kept = chosen[:, cluster]  # [B, V]
        floor = jnp.min(jnp.where(kept, logits, jnp.inf), axis=-1, keepdims=True) - 1.0
        return jnp.where(kept, logits, floor)  # [B, V]


def load_gemma4_assistant(folder: str, dtype=jnp.float32):
    """(assistant, params, None) from a "gemma4_assistant" folder."""
    dtype = check_load_dtype(dtype)
    path = os.path.join(folder, "config.json")
    config = read_json_object(path)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{path}: text_config={text!r}; allowed: an object")
    text = {**text, "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": text.get("hidden_size_per_layer_input") or 0}
    text_config = gemma4_config(text, where=path)
    text_config = dataclasses.replace(text_config, tie_word_embeddings=bool(
        config.get("tie_word_embeddings", True)))
    assistant = Gemma4Assistant(Gemma4AssistantConfig(
        text=text_config,
        backbone_hidden_size=check_int("backbone_hidden_size", config.get(
            "backbone_hidden_size", 1536), 1, 2**16, path),
        use_ordered_embeddings=bool(config.get("use_ordered_embeddings", False)),
        num_centroids=check_int("num_centroids", config.get("num_centroids", 2048), 1,
                                2**24, path),
        centroid_intermediate_top_k=check_int("centroid_intermediate_top_k", config.get(
            "centroid_intermediate_top_k", 32), 1, 2**24, path)))
    tensors = read_hf_tensors(folder, integer=("masked_embedding.token_ordering",))
    shapes = assistant.param_shapes()
    params = {}
    for key, name in (("pre_projection", "pre_projection.weight"),
                      ("post_projection", "post_projection.weight"),
                      ("centroids", "masked_embedding.centroids.weight")):
        if key in shapes:
            if name not in tensors:
                raise ValueError(f"{folder}: the checkpoint has no tensor {name!r}")
            params[key] = jnp.asarray(np.asarray(tensors[name], np.float32).T, dtype)
    if "token_ordering" in shapes:
        params["token_ordering"] = jnp.asarray(
            np.asarray(tensors["masked_embedding.token_ordering"]), jnp.int32)
    if "lm_head" in shapes:
        params["lm_head"] = read_lm_head(tensors, shapes["lm_head"], dtype, f"{folder}: ")
    text_params = _assistant_text_params(assistant, tensors, dtype, folder)
    params.update(text_params)
    assistant.check_params(params)
    return assistant, params, None


def _assistant_text_params(assistant, tensors, dtype, folder):
    """embed, final_norm and the layers under "model." (HF's text model names)."""
    text = assistant.config.text
    shared = dataclasses.replace(text, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                                 tie_word_embeddings=True)
    model = _NoKVGemma4(shared)
    return gemma4_params(model, tensors, "model.", dtype, where=folder)


class _NoKVGemma4(Gemma4):
    """The assistant's layers as a Gemma4 whose layers have no K / V (for gemma4_params)."""

    def param_shapes(self) -> dict:
        shapes = super().param_shapes()
        for layer in shapes["layers"]:
            for key in ("wk", "wv", "k_norm"):
                layer.pop(key, None)
        return shapes
