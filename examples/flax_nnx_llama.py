"""A Llama written in Flax NNX as a researcher would, decoded by jaxgen through `from_flax`.

The model: token embedding, RMSNorm, RoPE, grouped-query attention through jaxgen's KV cache
(one `cached_attention` call per layer), a SwiGLU MLP, a tied or untied LM head. Its forward
meets jaxgen's Flax protocol: `model(tokens [B, S], positions [B, S], cache) -> (logits
[B, S, V], cache)`, and `LlamaArgs` carries the sizes the adapter reads (vocab_size,
num_layers, num_kv_heads, head_dim, max_position_embeddings) as `model.config`.

`from_jaxgen_llama(config, params)` builds one holding the weights of a jaxgen Llama (e.g.
SmolLM2-135M-Instruct from `jaxgen.models.load(jaxgen.models.DEFAULT_MODEL)`), parameter by
parameter, so both decode the same tokens.

Example (run from this folder, or with it on sys.path):
    >>> import jaxgen
    >>> from jaxgen.models import from_flax, tiny_llama
    >>> llama, llama_params = tiny_llama()
    >>> module = from_jaxgen_llama(llama.config, llama_params)
    >>> model, params = from_flax(module)
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=5)
    >>> ours = jaxgen.generate_ids(model, params, [[1, 2, 3]], cfg)
    >>> ours == jaxgen.generate_ids(llama, llama_params, [[1, 2, 3]], cfg)
    True
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxgen.models.flax_adapter import cached_attention


@dataclasses.dataclass(frozen=True)
class LlamaArgs:
    """The model's sizes (static and hashable: it lives in the NNX graph definition)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)  # [..., 1]
        return self.weight[...] * (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)


def rope_cos_sin(positions, head_dim: int, theta: float, dtype):
    """cos, sin [B, S, Dh] for int positions [B, S] (the rotate-half convention)."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim  # [Dh/2]
    inv_freq = 1.0 / (jnp.float32(theta) ** exponents)  # [Dh/2]
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, S, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, S, Dh]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x, cos, sin):
    """x [B, S, N, Dh] rotated by position."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, S, N, Dh]
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Attention(nnx.Module):
    def __init__(self, args: LlamaArgs, layer: int, rngs: nnx.Rngs):
        d, h, k, dh = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nnx.Linear(d, h * dh, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(d, k * dh, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(d, k * dh, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(h * dh, d, use_bias=False, rngs=rngs)
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, h, k, dh

    def __call__(self, x, cos, sin, positions, cache):
        batch, seq, _ = x.shape
        q = self.q_proj(x).reshape(batch, seq, self.heads, self.head_dim)  # [B, S, H, Dh]
        k = self.k_proj(x).reshape(batch, seq, self.kv_heads, self.head_dim)  # [B, S, K, Dh]
        v = self.v_proj(x).reshape(batch, seq, self.kv_heads, self.head_dim)  # [B, S, K, Dh]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, cache = cached_attention(cache, self.layer, q, k, v, positions)  # [B, S, H, Dh]
        return self.o_proj(out.reshape(batch, seq, self.heads * self.head_dim)), cache


class MLP(nnx.Module):
    def __init__(self, args: LlamaArgs, rngs: nnx.Rngs):
        d, f = args.hidden_size, args.intermediate_size
        self.gate_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(f, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, S, D]


class Block(nnx.Module):
    def __init__(self, args: LlamaArgs, layer: int, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer, rngs)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, rngs)

    def __call__(self, x, cos, sin, positions, cache):
        attn, cache = self.self_attn(self.input_layernorm(x), cos, sin, positions, cache)
        x = x + attn  # [B, S, D]
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class FlaxLlama(nnx.Module):
    def __init__(self, args: LlamaArgs, rngs: nnx.Rngs):
        self.config = args
        self.embed_tokens = nnx.Embed(args.vocab_size, args.hidden_size, rngs=rngs)
        self.layers = nnx.List([Block(args, i, rngs) for i in range(args.num_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nnx.Linear(
            args.hidden_size, args.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions, cache):
        x = self.embed_tokens(tokens)  # [B, S, D]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for block in self.layers:
            x, cache = block(x, cos, sin, positions, cache)
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits, cache  # [B, S, V]


def from_jaxgen_llama(config, params) -> FlaxLlama:
    """A FlaxLlama holding a jaxgen Llama's weights (config: its LlamaConfig; params: its
    stacked params, e.g. from jaxgen.models.load or tiny_llama), copied one by one."""
    unsupported = {"rope_scaling": config.rope_scaling, "sliding_window": config.sliding_window,
                   "attention_bias": config.attention_bias or None,
                   "attention_out_bias": config.attention_out_bias or None,
                   "qk_norm": config.qk_norm or None}
    for name, value in unsupported.items():
        if value is not None:
            raise ValueError(f"{name}={value!r}: this example Llama has plain RoPE, full "
                             f"attention and no biases or q/k norms")
    args = LlamaArgs(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings)
    model = nnx.eval_shape(lambda: FlaxLlama(args, nnx.Rngs(0)))  # shapes only, no init
    model.embed_tokens.embedding.set_value(params["embed"])  # [V, D]
    layers = params["layers"]  # each [L, ...]
    for i, block in enumerate(model.layers):
        attn, mlp = block.self_attn, block.mlp
        block.input_layernorm.weight.set_value(layers["attn_norm"][i])
        block.post_attention_layernorm.weight.set_value(layers["mlp_norm"][i])
        for linear, name in ((attn.q_proj, "wq"), (attn.k_proj, "wk"), (attn.v_proj, "wv"),
                             (attn.o_proj, "wo"), (mlp.gate_proj, "w_gate"),
                             (mlp.up_proj, "w_up"), (mlp.down_proj, "w_down")):
            linear.kernel.set_value(layers[name][i])  # [in, out], as jaxgen stores it
    model.norm.weight.set_value(params["final_norm"])
    if model.lm_head is not None:
        model.lm_head.kernel.set_value(params["lm_head"])  # [D, V]
    return model
