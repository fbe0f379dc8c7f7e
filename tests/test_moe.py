"""The shared MoE layer (jaxgen/models/moe.py): routing against a direct numpy transcription and
against transformers' Glm4MoeTopkRouter / Glm4MoeMoE / DeepseekV3MoE on random inputs (group
limits, correction bias, scaling, with and without normalized weights), exact ties, both
dispatches equal, static shapes, expert-wise sharding, the config checks and the checkpoint
reader (per-expert and fused tensors)."""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.models.moe import (
    MOE_SHARDING_RULES,
    MoeConfig,
    moe_mlp,
    moe_shapes,
    read_moe_layer,
    route,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D = 16
CONFIGS = {
    "groups": MoeConfig(num_experts=8, experts_per_token=2, expert_size=8, shared_experts=1,
                        groups=4, groups_per_token=2, normalize_weights=True, scaling=2.5),
    "no_groups_unnormed": MoeConfig(num_experts=6, experts_per_token=3, expert_size=4,
                                    shared_experts=0, groups=1, groups_per_token=1,
                                    normalize_weights=False, scaling=1.0),
    "two_shared": MoeConfig(num_experts=8, experts_per_token=4, expert_size=4,
                            shared_experts=2, groups=2, groups_per_token=1,
                            normalize_weights=True, scaling=1.0),
}


def random_params(config: MoeConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {name: (0.5 * rng.normal(size=shape)).astype(np.float32)
            for name, shape in moe_shapes(config, D).items()}


def reference_route(p: dict, x: np.ndarray, config: MoeConfig):
    """The router, token by token, in float64: lower index first on equal scores."""
    e, g = config.num_experts, config.groups
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ p["router"].astype(np.float64))))
    choice = scores + p["router_bias"]
    weights, indices = [], []
    for t in range(x.shape[0]):
        per_group = choice[t].reshape(g, e // g)
        group_score = np.sort(per_group, axis=1)[:, ::-1][:, :2].sum(1)
        kept = sorted(range(g), key=lambda i: (-group_score[i], i))[:config.groups_per_token]
        allowed = [j for j in range(e) if j // (e // g) in kept]
        chosen = sorted(allowed, key=lambda j: (-choice[t, j], j))[:config.experts_per_token]
        w = scores[t, chosen]
        if config.normalize_weights:
            w = w / (w.sum() + 1e-20)
        weights.append(w * config.scaling)
        indices.append(chosen)
    return np.array(weights), np.array(indices)


def reference_mlp(p: dict, x: np.ndarray, config: MoeConfig) -> np.ndarray:
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    weights, indices = reference_route(p, x, config)
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for w, j in zip(weights[t], indices[t]):
            h = silu(x[t] @ p["experts_gate"][j]) * (x[t] @ p["experts_up"][j])
            out[t] += w * (h @ p["experts_down"][j])
    if config.shared_experts:
        out += (silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    return out


def _as_set(indices) -> list:
    return [sorted(row) for row in np.asarray(indices).tolist()]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_routing_and_mlp_equal_the_reference(name):
    config = CONFIGS[name]
    p = random_params(config, seed=1)
    x = np.random.default_rng(2).normal(size=(40, D)).astype(np.float32)
    weights, indices = route(p, jnp.asarray(x), config)
    want_w, want_i = reference_route(p, x, config)
    assert _as_set(indices) == _as_set(want_i)
    order = np.argsort(np.asarray(indices), 1)
    want_order = np.argsort(want_i, 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(want_w, want_order, 1), rtol=1e-5)
    want = reference_mlp(p, x, config)
    for dispatch in ("dense", "sorted"):
        got = moe_mlp(p, jnp.asarray(x).reshape(4, 10, D), config, dispatch=dispatch)
        np.testing.assert_allclose(np.asarray(got).reshape(40, D), want, atol=2e-5, rtol=1e-4)


def test_the_group_limit_changes_the_choice():
    """With all groups kept the choice is the plain top-k; the limit moves some tokens."""
    config = CONFIGS["groups"]
    p = random_params(config, seed=3)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(64, D)), jnp.float32)
    unlimited = MoeConfig(**{**config.__dict__, "groups_per_token": config.groups})
    limited_i = _as_set(route(p, x, config)[1])
    plain_i = _as_set(route(p, x, unlimited)[1])
    assert limited_i != plain_i
    top = np.argsort(-(jax.nn.sigmoid(x @ p["router"]) + p["router_bias"]), axis=1)[:, :2]
    assert plain_i == _as_set(top)


def test_ties_take_the_lower_index():
    """Equal scores: the lower expert (and group) index is chosen, as the reference does
    (torch.topk's choice among exact ties on CPU is unspecified; random floats have none)."""
    config = MoeConfig(num_experts=8, experts_per_token=2, expert_size=4, shared_experts=0,
                       groups=4, groups_per_token=2, normalize_weights=True, scaling=1.0)
    p = random_params(config)
    p["router"] = np.zeros_like(p["router"])  # every score sigmoid(0) = 0.5
    p["router_bias"] = np.array([0, 0, 0.1, 0.1, 0.1, 0.1, 0, 0], np.float32)  # groups 1, 2 tie
    x = np.ones((3, D), np.float32)
    weights, indices = route(p, jnp.asarray(x), config)
    assert _as_set(indices) == _as_set(reference_route(p, x, config)[1]) == [[2, 3]] * 3
    np.testing.assert_allclose(np.asarray(weights), 0.5)
    p["router_bias"] = np.zeros_like(p["router_bias"])  # all equal: experts 0 and 1
    assert _as_set(route(p, jnp.asarray(x), config)[1]) == [[0, 1]] * 3


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_equals_transformers_moe_block(family):
    """transformers' MoE block (router, experts, shared experts) on random weights and inputs."""
    if family == "glm4_moe":
        cfg_cls, block = transformers.Glm4MoeConfig, "Glm4MoeMoE"
        module = transformers.models.glm4_moe.modeling_glm4_moe
    else:
        cfg_cls, block = transformers.DeepseekV3Config, "DeepseekV3MoE"
        module = transformers.models.deepseek_v3.modeling_deepseek_v3
    hf_config = cfg_cls(hidden_size=D, moe_intermediate_size=8, n_routed_experts=8,
                        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                        routed_scaling_factor=1.7, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = getattr(module, block)(hf_config).eval()
    with torch.no_grad():
        for tensor in [*hf.parameters(), *hf.buffers()]:
            tensor.copy_(0.5 * torch.randn(tensor.shape))
    state = {f"mlp.{k}": v.numpy() for k, v in hf.state_dict().items()}
    config = MoeConfig.from_hf_dict(hf_config.to_dict())
    p = read_moe_layer(lambda n: state[n], "mlp.", config, set(state))
    x = np.random.default_rng(5).normal(size=(2, 12, D)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.tensor(x)).numpy()
    got = moe_mlp({k: jnp.asarray(v) for k, v in p.items()}, jnp.asarray(x), config)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-4)


def test_shapes_are_static():
    """No data-dependent shape: every value in both dispatches' programs has a fixed shape."""
    config = CONFIGS["groups"]
    p = {k: jnp.asarray(v) for k, v in random_params(config).items()}
    for dispatch in ("dense", "sorted"):
        jaxpr = jax.make_jaxpr(lambda p, x, d=dispatch: moe_mlp(p, x, config, d))(
            p, jnp.ones((2, 5, D)))

        def shapes(jaxpr):
            for eqn in jaxpr.eqns:
                for var in eqn.outvars:
                    yield tuple(getattr(var.aval, "shape", ()))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    yield from shapes(sub)

        assert all(isinstance(d, int) for shape in shapes(jaxpr.jaxpr) for d in shape)
    # and one compiled program serves every routing outcome
    compiled = jax.jit(lambda p, x: moe_mlp(p, x, config))
    compiled(p, jnp.ones((2, 5, D)))
    compiled(p, -jnp.ones((2, 5, D)))
    assert compiled._cache_size() == 1


def test_experts_shard_by_expert():
    from jaxgen.models.param_sharding import _spec

    assert MOE_SHARDING_RULES["experts_gate"] == MOE_SHARDING_RULES["experts_down"] == -3
    for name, shape in moe_shapes(CONFIGS["groups"], D).items():
        spec = _spec(len(shape) + 1, MOE_SHARDING_RULES.get(name))  # with a layer axis
        if name.startswith("experts_"):
            assert tuple(spec) == (None, "model", None, None), name  # [L, E, ., .]
        elif name.startswith("router"):
            assert "model" not in tuple(spec), name


def test_config_checks_name_the_field():
    good = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=1.0)
    assert MoeConfig.from_hf_dict(good).groups == 2
    for bad, needle in [(dict(n_group=3), r"n_group=3 does not divide n_routed_experts=8"),
                        (dict(n_group=8), r"leaves 1 expert per group"),
                        (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 exceeds the 4"),
                        (dict(topk_group=3), r"topk_group=3 is out of range"),
                        (dict(norm_topk_prob="yes"), r"norm_topk_prob='yes'; allowed"),
                        (dict(routed_scaling_factor=-1.0), r"routed_scaling_factor=-1.0"),
                        (dict(n_routed_experts=None), r"n_routed_experts=None")]:
        with pytest.raises(ValueError, match=needle):
            MoeConfig.from_hf_dict({**good, **bad}, where="config.json")
    with pytest.raises(ValueError, match="dispatch='ragged'"):
        moe_mlp({}, jnp.ones((1, 1, D)), MoeConfig.from_hf_dict(good), dispatch="ragged")
