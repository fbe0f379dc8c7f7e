"""Mixture of experts as DeepSeek-V3 and GLM-4.5 compute it: sigmoid router, group-limited top-k.

Routing (transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter, per token, in float32):

    scores   = sigmoid(x @ router)                       [T, E]
    choice   = scores + router_bias                      (e_score_correction_bias: the choice only)
    group    = sum of the top-2 `choice` of each of the `groups` groups of E / groups experts
    keep the `groups_per_token` best groups, mask the other groups' experts out (-inf),
    indices  = top `experts_per_token` of the masked `choice`
    weights  = scores[indices] (/ their sum + 1e-20 when normalize_weights) * scaling

The MLP adds the chosen SwiGLU experts, weighted, and `shared_experts` shared SwiGLU experts
(one MLP of width shared_experts * expert_size) applied to every token.

Equal scores: `jax.lax.top_k` keeps the lower expert (or group) index first. torch.topk's
choice among exactly equal values on CPU depends on its sorting algorithm (not specified), so
exact ties are the one case where the choice may differ from transformers'; random float
weights do not produce them.

Dispatch: every shape is static (no data-dependent sizes), so the layer compiles once under
jit and runs inside `jax.lax.scan`. Two dispatches are written here: dense (`_dense_experts`:
every expert on every token, the unchosen ones weighted 0) and sorted segments
(`_sorted_experts`: the T*k (token, expert) pairs sorted by expert, `jax.lax.ragged_dot` over
the E segments, capacity T*k so no token is dropped). `moe_mlp` uses the dense one: measured
on this CPU (2 shared cores, fp32, E=8, k=2, D=256, F=128, jitted, median of 50 runs, two
sessions) a batch-1 decode step took 0.21-0.28 ms dense against 0.40 ms sorted, a 64-token
prefill 2.4-2.7 ms dense against 3.1-3.3 ms sorted (see docs/DESIGN.md). The dense
dispatch does E/k times the expert arithmetic, so with hundreds of experts the sorted one
should win (not measured here); `moe_mlp(..., dispatch="sorted")` selects it.

Params of one layer (`moe_shapes`; a family stacks them on a leading layer axis):

    router        [D, E]        router_bias [E]
    experts_gate  [E, D, F]     experts_up  [E, D, F]     experts_down [E, F, D]
    shared_gate   [D, Fs]       shared_up   [D, Fs]       shared_down  [Fs, D]  (shared_experts > 0)

Example:
    >>> config = MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, shared_experts=1,
    ...                    groups=2, groups_per_token=1, normalize_weights=True, scaling=1.0)
    >>> shapes = moe_shapes(config, hidden=16)
    >>> p = {name: jnp.full(shape, 0.01) for name, shape in shapes.items()}
    >>> moe_mlp(p, jnp.ones((2, 3, 16)), config).shape
    (2, 3, 16)
    >>> weights, indices = route(p, jnp.ones((1, 16)), config)
    >>> indices.tolist(), [round(w, 3) for w in weights[0].tolist()]
    ([[0, 1]], [0.5, 0.5])
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.models.config_checks import FLOAT32_MAX, check_float, check_int

__all__ = ["MoeConfig", "MOE_SHARDING_RULES", "moe_mlp", "moe_shapes", "read_moe_layer", "route"]

# param name -> the dimension (from the end) on the mesh's "model" axis: the routed experts by
# expert (each device holds E/m whole experts), the shared MLP Megatron-style.
MOE_SHARDING_RULES = {"experts_gate": -3, "experts_up": -3, "experts_down": -3,
                      "shared_gate": -1, "shared_up": -1, "shared_down": -2}
DISPATCHES = ("dense", "sorted")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Static, hashable MoE description (HF names in the comments)."""

    num_experts: int          # n_routed_experts
    experts_per_token: int    # num_experts_per_tok
    expert_size: int          # moe_intermediate_size
    shared_experts: int       # n_shared_experts (shared MLP width = shared_experts * expert_size)
    groups: int               # n_group
    groups_per_token: int     # topk_group
    normalize_weights: bool   # norm_topk_prob
    scaling: float            # routed_scaling_factor

    def __post_init__(self):
        _check(dataclasses.asdict(self), "")

    @classmethod
    def from_hf_dict(cls, config: Mapping, where: str = "") -> "MoeConfig":
        """From a config.json dict (HF field names; transformers' defaults where absent).
        Raises ValueError naming the config.json field on a bad value."""
        values = {name: config.get(hf, default) for name, (hf, default) in _HF_FIELDS.items()}
        _check(values, where)
        return cls(**values)


_HF_FIELDS = {  # MoeConfig field -> (config.json name, transformers' default)
    "num_experts": ("n_routed_experts", None),
    "experts_per_token": ("num_experts_per_tok", None),
    "expert_size": ("moe_intermediate_size", None),
    "shared_experts": ("n_shared_experts", 0),
    "groups": ("n_group", 1),
    "groups_per_token": ("topk_group", 1),
    "normalize_weights": ("norm_topk_prob", True),
    "scaling": ("routed_scaling_factor", 1.0),
}


def _check(values: Mapping, where: str) -> None:
    """ValueError naming the config.json field unless every MoE number is in range and they
    fit each other (groups divide the experts, enough experts in the kept groups)."""
    name = {field: hf for field, (hf, _) in _HF_FIELDS.items()}
    experts = check_int(name["num_experts"], values["num_experts"], 1, 2**16, where)
    per_token = check_int(name["experts_per_token"], values["experts_per_token"], 1, experts,
                          where)
    check_int(name["expert_size"], values["expert_size"], 1, 2**18, where)
    check_int(name["shared_experts"], values["shared_experts"], 0, 1024, where)
    groups = check_int(name["groups"], values["groups"], 1, experts, where)
    kept = check_int(name["groups_per_token"], values["groups_per_token"], 1, groups, where)
    prefix = f"{where}: " if where else ""
    if experts % groups:
        raise ValueError(f"{prefix}n_group={groups} does not divide n_routed_experts={experts}; "
                         f"allowed: a divisor of n_routed_experts")
    if groups > 1 and experts // groups < 2:
        raise ValueError(f"{prefix}n_group={groups} leaves {experts // groups} expert per group; "
                         f"allowed: at least 2 experts per group (a group scores its top 2)")
    if kept * (experts // groups) < per_token:
        raise ValueError(f"{prefix}num_experts_per_tok={per_token} exceeds the "
                         f"{kept * (experts // groups)} experts of topk_group={kept} groups; "
                         f"allowed: at most topk_group * n_routed_experts / n_group")
    if not isinstance(values["normalize_weights"], (bool, np.bool_)):
        raise ValueError(f"{prefix}norm_topk_prob={values['normalize_weights']!r}; allowed: "
                         f"true or false")
    check_float(name["scaling"], values["scaling"], 0.0, FLOAT32_MAX, where)


def moe_shapes(config: MoeConfig, hidden: int) -> dict:
    """One layer's MoE parameter shapes (no layer axis): see the module docs."""
    e, d, f = config.num_experts, hidden, config.expert_size
    shapes = {"router": (d, e), "router_bias": (e,),
              "experts_gate": (e, d, f), "experts_up": (e, d, f), "experts_down": (e, f, d)}
    if config.shared_experts:
        fs = config.shared_experts * f
        shapes.update(shared_gate=(d, fs), shared_up=(d, fs), shared_down=(fs, d))
    return shapes


def route(p: Mapping, x: jax.Array, config: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """The router: x [T, D] -> (weights [T, k] float32, expert indices [T, k] int32)."""
    e, g = config.num_experts, config.groups
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)  # [T, E]
    scores = jax.nn.sigmoid(logits)  # [T, E]
    choice = scores + p["router_bias"].astype(jnp.float32)  # [T, E]
    if config.groups_per_token < g:  # group limit (all groups kept: nothing masked)
        grouped = choice.reshape(-1, g, e // g)  # [T, G, E/G]
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        best = jax.lax.top_k(group_scores, config.groups_per_token)[1]  # [T, Gk]
        keep = jax.nn.one_hot(best, g, dtype=jnp.bool_).any(-2)  # [T, G]
        keep = jnp.repeat(keep, e // g, axis=-1)  # [T, E]
        choice = jnp.where(keep, choice, -jnp.inf)  # [T, E]
    indices = jax.lax.top_k(choice, config.experts_per_token)[1]  # [T, k]
    weights = jnp.take_along_axis(scores, indices, axis=-1)  # [T, k]
    if config.normalize_weights:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)  # [T, k]
    return weights * config.scaling, indices.astype(jnp.int32)


def _swiglu(x, gate, up, down):
    """SwiGLU MLP: x [.., D] with gate/up [D, F], down [F, D] -> [.., D]."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def _dense_experts(p, x, weights, indices, num_experts):
    """Every expert on every token, weighted (0 where unchosen): x [T, D] -> [T, D]."""
    combine = (jax.nn.one_hot(indices, num_experts, dtype=jnp.float32)
               * weights[..., None]).sum(-2)  # [T, E]
    gate = jnp.einsum("td,edf->tef", x, p["experts_gate"])  # [T, E, F]
    up = jnp.einsum("td,edf->tef", x, p["experts_up"])  # [T, E, F]
    out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, p["experts_down"])  # [T, E, D]
    return jnp.einsum("ted,te->td", out.astype(jnp.float32), combine).astype(x.dtype)


def _sorted_experts(p, x, weights, indices, num_experts):
    """Sorted segments: the T*k (token, expert) pairs grouped by expert, one ragged matmul per
    projection (capacity T*k: nothing dropped): x [T, D] -> [T, D]."""
    t, k = indices.shape
    flat = indices.reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True)  # [T*k]
    token = order // k  # [T*k] the token of each sorted pair
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
    rows = x[token]  # [T*k, D]
    gate = jax.lax.ragged_dot(rows, p["experts_gate"], sizes)  # [T*k, F]
    up = jax.lax.ragged_dot(rows, p["experts_up"], sizes)  # [T*k, F]
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["experts_down"], sizes)  # [T*k, D]
    out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]  # [T*k, D]
    return jax.ops.segment_sum(out, token, num_segments=t).astype(x.dtype)  # [T, D]


def moe_mlp(p: Mapping, x: jax.Array, config: MoeConfig, dispatch: str = "dense") -> jax.Array:
    """The MoE MLP of one layer: x [B, S, D] -> [B, S, D] (routed experts + shared experts).
    dispatch: "dense" or "sorted" (same result; see the module docs)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch={dispatch!r}; allowed: {', '.join(map(repr, DISPATCHES))}")
    shape = x.shape
    flat = x.reshape(-1, shape[-1])  # [T, D]
    weights, indices = route(p, flat, config)  # [T, k], [T, k]
    experts = _dense_experts if dispatch == "dense" else _sorted_experts
    out = experts(p, flat, weights, indices, config.num_experts)  # [T, D]
    if config.shared_experts:
        out = out + _swiglu(flat, p["shared_gate"], p["shared_up"], p["shared_down"])  # [T, D]
    return out.reshape(shape)


def read_moe_layer(fetch: Callable[[str], np.ndarray], prefix: str, config: MoeConfig,
                   names: set) -> dict:
    """One layer's MoE params (numpy, the `moe_shapes` layout) from a HF checkpoint's tensors
    under `prefix` (e.g. "model.layers.3.mlp.").

    Reads the per-expert names transformers' save_pretrained writes
    (experts.{j}.gate_proj.weight [F, D], up_proj, down_proj [D, F]) or the fused tensors of
    transformers' in-memory layout (experts.gate_up_proj [E, 2F, D], experts.down_proj
    [E, D, F]); `fetch(name)` returns a tensor (and marks it used) or None for a missing one
    (the entry is then None: the caller reports it), `names` holds every name.
    """
    e = config.num_experts
    p = {"router": _t(fetch(prefix + "gate.weight")),  # [E, D] -> [D, E]
         "router_bias": fetch(prefix + "gate.e_score_correction_bias")}  # [E]
    fused = prefix + "experts.gate_up_proj"
    if fused in names:
        gate_up, down = fetch(fused), fetch(prefix + "experts.down_proj")  # [E, 2F, D], [E, D, F]
        f = None if gate_up is None else gate_up.shape[1] // 2
        p["experts_gate"] = None if f is None else np.swapaxes(gate_up[:, :f], 1, 2)  # [E, D, F]
        p["experts_up"] = None if f is None else np.swapaxes(gate_up[:, f:], 1, 2)  # [E, D, F]
        p["experts_down"] = None if down is None else np.swapaxes(down, 1, 2)  # [E, F, D]
    else:
        def stacked(proj):
            arrays = [_t(fetch(f"{prefix}experts.{j}.{proj}.weight")) for j in range(e)]
            return None if any(a is None for a in arrays) else np.stack(arrays)
        p["experts_gate"] = stacked("gate_proj")  # [E, D, F]
        p["experts_up"] = stacked("up_proj")  # [E, D, F]
        p["experts_down"] = stacked("down_proj")  # [E, F, D]
    if config.shared_experts:
        for ours, theirs in (("shared_gate", "gate_proj"), ("shared_up", "up_proj"),
                             ("shared_down", "down_proj")):
            p[ours] = _t(fetch(f"{prefix}shared_experts.{theirs}.weight"))
    return p


def _t(array):
    """A stored [out, in] matrix as [in, out] (None stays None: a missing tensor)."""
    return None if array is None else array.T
