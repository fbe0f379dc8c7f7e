"""The MTP drafter (Gemma 4 style, for any Llama-family target): a light assistant with its own
few layers and no embeddings of its own, which drafts from the target's state.

One draft step for a row whose newest token t sits at position P (its K/V is not in the
target's cache yet; the cache holds positions < P):

    e      = target.embed(t)                                     [Dt] the target's embeddings
    x      = [rms(e) * embed_norm ; rms(h) * hidden_norm] @ pre_projection     [D]
             h: the target's last hidden state (before its final norm) that predicted t; from
             a round's second step on, the drafter's own projected state g of the step before
    layer n:  x += attention(rms(x) * attn_norm)     queries only (RoPE at P, the target's rope
                                                     settings); keys / values are the target's
                                                     cached K/V of layer kv_layers[n] at
                                                     positions < P (inside its sliding window)
              x += swiglu(rms(x) * mlp_norm)
    g      = (rms(x) * final_norm) @ post_projection             [Dt] fed back as the next h
    logits = target.head(g)                                      the target's final norm + head
             (with a draft vocabulary: only its rows, -inf elsewhere, jaxgen/models/draft_vocab.py)

Every step of a round queries at the same position P (Hugging Face's single-position drafting):
the drafts are not in the target's cache, so they reach the drafter through e and g only.
Unlike Gemma 4's assistant the drafter has no LM head or embeddings of its own, and it reads the
target's pre-norm hidden state (what jaxgen's verify forward hands over), normalised by
`hidden_norm`.

Params layout (N drafter layers, D its width, F its MLP width, H its query heads; Dt, Dh, V the
target's hidden size, head dim and vocabulary):

    embed_norm       [Dt]
    hidden_norm      [Dt]
    pre_projection   [2 Dt, D]        rows: embedding first, then the hidden state
    layers/
      attn_norm      [N, D]
      wq             [N, D, H*Dh]
      q_norm         [N, Dh]          (q_norm)
      wo             [N, H*Dh, D]
      mlp_norm       [N, D]
      w_gate         [N, D, F]
      w_up           [N, D, F]
      w_down         [N, F, D]
    final_norm       [D]
    post_projection  [D, Dt]
    draft_head       [Dt, V_d]        optional, with a draft vocabulary: the target's head rows
                                      for its V_d tokens, contiguous (drafter_with_draft_head);
                                      without it the rows are read from the target's params

A pruned draft vocabulary (config.draft_vocab, sorted token ids) makes the head cost V_d / V
of the target's: q is zero outside it, so verification stays exact (as for DraftVocabModel).

Example (tests/test_mtp_assistant.py runs it):
    >>> from jaxgen.models import Llama, LlamaConfig
    >>> shapes = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_heads=2,
    ...               num_kv_heads=1, head_dim=8)
    >>> target = Llama(LlamaConfig(num_layers=2, **shapes))
    >>> config = MtpDrafterConfig.for_target(target.config, hidden_size=8,
    ...                                      intermediate_size=16, num_layers=1)
    >>> drafter = MtpDrafterModel(config)
    >>> drafter.config.kv_layers, param_shapes(drafter.config)["pre_projection"]
    ((1,), (32, 8))
    >>> drafter.check_target(target)                                   # fits: None
    >>> drafter.check_target(Llama(LlamaConfig(num_layers=3, **shapes)))
    Traceback (most recent call last):
    ...
    ValueError: the MTP drafter was built for ... num_hidden_layers=2, but ... num_hidden_layers=3
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxgen.models import rope as rope_lib
from jaxgen.models.config_checks import FLOAT_LIMITS, INT_LIMITS, check_float
from jaxgen.models.llama import apply_rope, rms_norm
from jaxgen.models.quantize import dense

MODEL_TYPE = "jaxgen_mtp_drafter"  # config.json "model_type"
ARCHITECTURE = "JaxgenMtpDrafter"  # config.json "architectures": [ARCHITECTURE]

# The target dimensions a drafter is built for: config field -> (the target config's field,
# Hugging Face's config.json name).
TARGET_FIELDS = {
    "target_hidden_size": ("hidden_size", "hidden_size"),
    "target_num_heads": ("num_heads", "num_attention_heads"),
    "target_num_kv_heads": ("num_kv_heads", "num_key_value_heads"),
    "target_head_dim": ("head_dim", "head_dim"),
    "target_vocab_size": ("vocab_size", "vocab_size"),
    "target_num_layers": ("num_layers", "num_hidden_layers"),
}

# What the drafter's queries read from the target's config to rotate like its keys.
ROPE_FIELDS = ("rope_theta", "rope_scaling", "max_position_embeddings")

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "MtpDrafterConfig", "MtpDrafterModel", "ROPE_FIELDS",
           "TARGET_FIELDS", "drafter_with_draft_head", "param_shapes"]


@dataclasses.dataclass(frozen=True)
class MtpDrafterConfig:
    """Static, hashable description of an MTP drafter: its own dimensions and the target's
    it was built for (checked against the target before anything compiles)."""

    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # N
    num_heads: int  # H: query heads (a multiple of the target's kv heads)
    target_hidden_size: int  # Dt
    target_num_heads: int
    target_num_kv_heads: int  # Hkv of the target's cache
    target_head_dim: int  # Dh of the target's cache
    target_vocab_size: int  # V
    target_num_layers: int
    kv_layers: tuple[int, ...]  # per drafter layer: the target layer whose cached K/V it reads
    rms_norm_eps: float = 1e-6
    q_norm: bool = False  # RMSNorm over head_dim on the queries (for Qwen3-style targets)
    draft_vocab: tuple[int, ...] = ()  # sorted token ids the drafter proposes; () = all

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     *TARGET_FIELDS):
            value = getattr(self, name)
            limit = INT_LIMITS[TARGET_FIELDS[name][0] if name in TARGET_FIELDS else name][1]
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise ValueError(f"MTP drafter config: {name}={value!r} is out of range; "
                                 f"allowed: an int in [1, {limit}]")
        object.__setattr__(self, "rms_norm_eps", check_float(
            "MTP drafter config: rms_norm_eps", self.rms_norm_eps, *FLOAT_LIMITS["rms_norm_eps"]))
        if self.num_heads % self.target_num_kv_heads:
            raise ValueError(f"MTP drafter config: num_heads={self.num_heads} must be a multiple "
                             f"of target_num_kv_heads={self.target_num_kv_heads} (its queries "
                             f"attend to the target's kv heads)")
        layers = tuple(self.kv_layers)
        if len(layers) != self.num_layers or not all(
                isinstance(i, int) and 0 <= i < self.target_num_layers for i in layers):
            raise ValueError(f"MTP drafter config: kv_layers={list(layers)} must hold "
                             f"num_layers={self.num_layers} target layer indices in [0, "
                             f"target_num_layers={self.target_num_layers})")
        object.__setattr__(self, "kv_layers", layers)
        vocab = tuple(int(t) for t in self.draft_vocab)
        if vocab and (any(b <= a for a, b in zip(vocab, vocab[1:])) or vocab[0] < 0
                      or vocab[-1] >= self.target_vocab_size):
            raise ValueError(f"MTP drafter config: draft_vocab must be sorted, distinct token "
                             f"ids in [0, target_vocab_size={self.target_vocab_size}), got "
                             f"{len(vocab)} ids")
        object.__setattr__(self, "draft_vocab", vocab)

    @classmethod
    def for_target(cls, target_config: Any, *, hidden_size: int, intermediate_size: int,
                   num_layers: int, num_heads: int | None = None,
                   kv_layers: tuple[int, ...] | None = None, **extra) -> "MtpDrafterConfig":
        """A drafter config fitted to a target config (jaxgen.models.LlamaConfig). Defaults:
        the target's query heads, every layer reading the target's last layer, the target's
        rms_norm_eps, q_norm when the target normalises its queries (Qwen3)."""
        target = {name: int(getattr(target_config, field))
                  for name, (field, _) in TARGET_FIELDS.items()}
        last = target["target_num_layers"] - 1
        extra.setdefault("rms_norm_eps", float(getattr(target_config, "rms_norm_eps", 1e-6)))
        extra.setdefault("q_norm", bool(getattr(target_config, "qk_norm", False)))
        return cls(hidden_size=hidden_size, intermediate_size=intermediate_size,
                   num_layers=num_layers,
                   num_heads=target["target_num_heads"] if num_heads is None else num_heads,
                   kv_layers=tuple(kv_layers) if kv_layers is not None else (last,) * num_layers,
                   **target, **extra)


@dataclasses.dataclass(frozen=True)
class MtpDrafterModel:
    """An MTP drafter model (hashable; static in the jit). Params are a plain dict passed in.

    `drafts_from_target` marks an assistant that cannot draft alone: the assisted loop takes
    it as a drafter that reads the target (jaxgen.speculative.drafters.mtp_assistant), not as a
    stand-alone draft model.
    """

    config: MtpDrafterConfig
    drafts_from_target: ClassVar[bool] = True
    model_type: ClassVar[str] = MODEL_TYPE

    @property
    def vocab_size(self) -> int:
        return self.config.target_vocab_size

    def init_params(self, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
        """Random parameters (normal with std `scale`; norms at 1) in the params layout."""
        def fill(shapes: dict, key: jax.Array) -> dict:
            keys = jax.random.split(key, len(shapes))
            return {name: fill(shape, k) if isinstance(shape, dict) else
                    jnp.ones(shape, dtype) if name.endswith("norm") else
                    (scale * jax.random.normal(k, shape)).astype(dtype)
                    for k, (name, shape) in zip(keys, sorted(shapes.items()))}
        return fill(param_shapes(self.config), key)

    def check_params(self, params: Any) -> None:
        """Raises ValueError naming the first parameter missing, unexpected or of the wrong
        shape (host-only: reads `.shape`)."""
        expected = param_shapes(self.config)
        if not isinstance(params, Mapping):
            raise ValueError(f"MTP drafter params is a {type(params).__name__}, expected a dict "
                             f"with keys {sorted(expected)}")
        if self.config.draft_vocab and "draft_head" in params:
            expected["draft_head"] = (self.config.target_hidden_size, len(self.config.draft_vocab))
        _check_tree(params, expected, "params")

    def check_target(self, target: Any) -> None:
        """Raises ValueError, naming the drafter's and the target's values, unless `target`
        is a model this drafter was built for (same dimensions, embed and head callable)."""
        config = getattr(target, "config", None)
        name = type(target).__name__
        missing = [m for m in ("embed", "head") if not callable(getattr(target, m, None))]
        fields = [field for field, _ in TARGET_FIELDS.values()] + list(ROPE_FIELDS)
        absent = [f for f in fields if not hasattr(config, f)]
        if missing or absent:
            what = ", ".join([f"method {m}" for m in missing] + [f"config.{f}" for f in absent])
            raise ValueError(f"the MTP drafter needs a Llama-family target (jaxgen.models.Llama); "
                             f"{name} has no {what}")
        built = {hf: getattr(self.config, mine) for mine, (_, hf) in TARGET_FIELDS.items()}
        actual = {hf: int(getattr(config, field)) for field, hf in TARGET_FIELDS.values()}
        wrong = [hf for hf in built if built[hf] != actual[hf]]
        if wrong:
            mine = ", ".join(f"{hf}={built[hf]}" for hf in wrong)
            theirs = ", ".join(f"{hf}={actual[hf]}" for hf in wrong)
            raise ValueError(f"the MTP drafter was built for a target with {mine}, but the "
                             f"target model ({name}) has {theirs}")

    def step(self, params: dict, target: Any, target_params: Any, token: jax.Array,
             hidden: jax.Array, position: jax.Array, cache: Any) -> tuple[jax.Array, jax.Array]:
        """One draft step (module docs) for every row.

        token int32 [B] (the token at `position`), hidden [B, Dt], position int32 [B] >= 1,
        cache: the target's cache (read only: positions < position). Returns (logits [B, V]
        float32, g [B, Dt] in hidden's dtype: the next step's hidden).
        """
        cfg = self.config
        g = self.project(params, target, target_params, token[:, None], hidden[:, None],
                         position[:, None], cache)  # [B, 1, Dt]
        g = g.astype(hidden.dtype)
        if cfg.draft_vocab:
            logits = self.vocab_logits(params, target, target_params, g[:, 0])  # [B, V]
        else:
            logits = target.head(target_params, g)[:, 0]  # [B, V] float32
        return logits, g[:, 0]

    def project(self, params: dict, target: Any, target_params: Any, tokens: jax.Array,
                hidden: jax.Array, positions: jax.Array, cache: Any) -> jax.Array:
        """The drafter's state g before the head, for S queries per row at once (training
        runs every position of a sequence in one call; a draft step is S = 1).

        tokens int32 [B, S], hidden [B, S, Dt], positions int32 [B, S] (query s reads the
        cached keys at positions < positions[b, s]). Returns g [B, S, Dt] in params' dtype.
        """
        cfg = self.config
        tcfg = target.config
        eps = cfg.rms_norm_eps
        dtype = params["pre_projection"].dtype
        embedded = target.embed(target_params, tokens).astype(dtype)  # [B, S, Dt]
        state = hidden.astype(dtype)  # [B, S, Dt]
        x = jnp.concatenate([rms_norm(embedded, params["embed_norm"], eps),
                             rms_norm(state, params["hidden_norm"], eps)], axis=-1)  # [B,S,2Dt]
        x = x @ params["pre_projection"]  # [B, S, D]
        positions = positions.astype(jnp.int32)  # [B, S]
        cos, sin = rope_lib.cos_sin(positions, cfg.target_head_dim, tcfg.rope_theta,
                                    tcfg.rope_scaling, tcfg.max_position_embeddings,
                                    dtype)  # [B, S, Dh] each
        window = getattr(tcfg, "sliding_window", None)
        for n, target_layer in enumerate(cfg.kv_layers):
            p = jax.tree_util.tree_map(lambda a: a[n], params["layers"])
            x = self._block(p, target_layer, x, cos, sin, positions - 1, cache, window)
        return rms_norm(x, params["final_norm"], eps) @ params["post_projection"]  # [B, S, Dt]

    def vocab_logits(self, params: dict, target: Any, target_params: Any,
                     g: jax.Array) -> jax.Array:
        """The target's final norm + head on the draft vocabulary's rows only: g [..., Dt] ->
        logits [..., V] float32, -inf outside config.draft_vocab."""
        from jaxgen.models.draft_vocab import restricted_logits

        vocab = self.config.draft_vocab
        head = {"final_norm": target_params["final_norm"]}
        if "draft_head" in params:
            head["draft_head"] = params["draft_head"]
        else:
            head.update({k: target_params[k] for k in ("lm_head", "embed") if k in target_params})
        small = restricted_logits(target, head, g, vocab)  # [..., V_d]
        full = jnp.full(small.shape[:-1] + (self.config.target_vocab_size,), -jnp.inf,
                        jnp.float32)  # [..., V]
        return full.at[..., jnp.asarray(vocab, jnp.int32)].set(small)  # [..., V]

    def _block(self, p: dict, target_layer: int, x: jax.Array, cos: jax.Array, sin: jax.Array,
               visible_to: jax.Array, cache: Any, window: int | None) -> jax.Array:
        """One drafter layer: queries over the target's cached K/V of `target_layer` (keys at
        positions <= visible_to [B, S]), then the SwiGLU MLP; both residual."""
        cfg = self.config
        batch, seq = x.shape[:2]
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)  # [B, S, D]
        q = (h @ p["wq"]).reshape(batch, seq, cfg.num_heads, cfg.target_head_dim)  # [B,S,H,Dh]
        if cfg.q_norm:
            q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)  # [B, S, H, Dh]
        q = apply_rope(q, cos, sin)  # [B, S, H, Dh]
        attn = cache.attend(target_layer, q, visible_to, scale=cfg.target_head_dim ** -0.5,
                            window=window)  # [B, S, H, Dh]
        attn = attn.astype(x.dtype).reshape(batch, seq, cfg.num_heads * cfg.target_head_dim)
        x = x + attn @ p["wo"]  # [B, S, D]
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)  # [B, S, D]
        return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]  # [B, S, D]


def drafter_with_draft_head(model: MtpDrafterModel, params: dict, target_params: dict) -> dict:
    """params plus "draft_head" [Dt, V_d]: the target's head rows for the draft vocabulary
    as one contiguous matrix (params unchanged without a draft vocabulary)."""
    import numpy as np

    vocab = np.asarray(model.config.draft_vocab, np.int32)
    if not len(vocab):
        return params
    if "lm_head" in target_params:
        head = np.asarray(dense(target_params["lm_head"]))[:, vocab]  # [Dt, V_d]
    else:
        head = np.asarray(target_params["embed"])[vocab].T  # [Dt, V_d]
    dtype = params["pre_projection"].dtype
    return {**params, "draft_head": jnp.asarray(np.ascontiguousarray(head), dtype)}


def param_shapes(config: MtpDrafterConfig) -> dict:
    """The expected shape of every parameter (a fresh nested dict)."""
    shapes = _shapes(config)
    return {k: dict(v) if isinstance(v, dict) else v for k, v in shapes.items()}


@functools.lru_cache(maxsize=32)
def _shapes(cfg: MtpDrafterConfig) -> dict:
    N, D, F, Dt = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size
    qd = cfg.num_heads * cfg.target_head_dim
    layers = {"attn_norm": (N, D), "wq": (N, D, qd), "wo": (N, qd, D), "mlp_norm": (N, D),
              "w_gate": (N, D, F), "w_up": (N, D, F), "w_down": (N, F, D)}
    if cfg.q_norm:
        layers["q_norm"] = (N, cfg.target_head_dim)
    return {"embed_norm": (Dt,), "hidden_norm": (Dt,), "pre_projection": (2 * Dt, D),
            "layers": layers, "final_norm": (D,), "post_projection": (D, Dt)}


def _check_tree(tree: Mapping, expected: dict, path: str) -> None:
    for key, shape in expected.items():
        if key not in tree:
            raise ValueError(f"MTP drafter {path} has no key {key!r}"
                             + ("" if isinstance(shape, dict) else f" (expected shape {shape})"))
    for key in tree:
        if key not in expected:
            raise ValueError(f"MTP drafter {path} has an unexpected key {key!r}; it uses "
                             f"{', '.join(sorted(expected))}")
    for key, shape in expected.items():
        value, where = tree[key], f"{path}[{key!r}]"
        if isinstance(shape, dict):
            if not isinstance(value, Mapping):
                raise ValueError(f"MTP drafter {where} is a {type(value).__name__}, expected a "
                                 f"dict")
            _check_tree(value, shape, where)
        elif tuple(getattr(value, "shape", ())) != tuple(shape) or not hasattr(value, "shape"):
            raise ValueError(f"MTP drafter {where} has shape "
                             f"{tuple(getattr(value, 'shape', ()))}, expected {tuple(shape)}")
