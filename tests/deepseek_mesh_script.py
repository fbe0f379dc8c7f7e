"""A DeepSeek-V3 model (MLA, latent cache, MoE, one MTP depth) on simulated 8-device CPU
meshes: the same tokens as one device (tests/test_deepseek_v3.py runs it in a subprocess and
reads its last JSON line: check -> ok)."""
from __future__ import annotations

import json
import os


import jax
import jax.numpy as jnp
import numpy as np

import jaxgen
from jaxgen.models import DeepseekV3, DeepseekV3Config
from jaxgen.models.moe import MoeConfig
from jaxgen.models.param_sharding import shard

PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9, 8, 9, 8, 9], [3, 3, 3, 3, 3], [1],
           [2, 4, 2, 4], [6, 6, 1], [7, 1, 2, 7, 1]]


def main() -> None:
    model = DeepseekV3(DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=8,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=1, num_mtp_layers=1,
        moe=MoeConfig(num_experts=8, experts_per_token=2, expert_size=16, shared_experts=1,
                      groups=2, groups_per_token=1, normalize_weights=True, scaling=2.5)))
    params = jax.tree_util.tree_map(lambda a: a * 4.0 if a.ndim >= 2 else a,
                                    model.init_params(jax.random.key(1)))
    eye = jnp.concatenate([jnp.eye(32), jnp.zeros((32, 32))])[None]  # [1, 2D, D]
    params["mtp"]["eh_proj"] = params["mtp"]["eh_proj"] + eye
    g = jaxgen.GenerationConfig
    base = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=63)
    cases = {"greedy": g(**base), "beam": g(**base, num_beams=2),
             "sampling": g(**base, do_sample=True, temperature=0.9),
             "use_mtp": g(**base, use_mtp=True, assistant_fallback=False)}
    checks = {}
    for name, cfg in cases.items():
        alone = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg,
                                                          jax.random.key(7)), cfg)
        for shape in ((2, 4), (1, 8)):
            mesh = jax.make_mesh(shape, ("data", "model"))
            state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(7), mesh=mesh)
            out = jaxgen.generate(shard(model, params, mesh), state, cfg)
            checks[f"{name} {shape}"] = bool(
                np.array_equal(np.asarray(out.sequences), np.asarray(alone.sequences))
                and np.array_equal(np.asarray(out.lengths), np.asarray(alone.lengths)))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    placed = shard(model, params, mesh)
    layers = placed["layers"]
    checks["heads of wkv_b on model"] = layers["wkv_b"].sharding.spec[-1] == "model"
    checks["experts on model"] = layers["experts_gate"].sharding.spec[1] == "model"
    checks["wkv_a replicated"] = "model" not in str(layers["wkv_a"].sharding.spec)
    state = jaxgen.init_state(model, PROMPTS, cases["greedy"], mesh=mesh)
    spec = state.cache.latent.sharding.spec  # [L, B, 1, T, R + P]: rows on data only
    checks["latent rows on data, whole on model"] = (spec[1] == "data"
                                                     and "model" not in str(spec))
    print(json.dumps(checks))


if __name__ == "__main__":  # 8 simulated devices, set before JAX first touches a device
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    main()
