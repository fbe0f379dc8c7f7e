"""A GLM-4.5 (MoE + MTP depth) model on simulated 8-device CPU meshes: the same tokens as one
device, experts split by expert (tests/test_glm4_moe.py runs it in a subprocess and reads its
last JSON line: check -> ok)."""
from __future__ import annotations

import json
import os


import jax
import jax.numpy as jnp
import numpy as np

import jaxgen
from jaxgen.models import Glm4Moe, Glm4MoeConfig
from jaxgen.models.moe import MoeConfig
from jaxgen.models.mtp import with_mtp
from jaxgen.models.param_sharding import shard

PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9, 8, 9, 8, 9], [3, 3, 3, 3, 3], [1],
           [2, 4, 2, 4], [6, 6, 1], [7, 1, 2, 7, 1]]


def main() -> None:
    moe = MoeConfig(num_experts=8, experts_per_token=2, expert_size=8, shared_experts=1,
                    groups=2, groups_per_token=1, normalize_weights=True, scaling=2.0)
    model = Glm4Moe(Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_layers=3, num_heads=8, num_kv_heads=8, head_dim=8,
                                  rotary_dim=4, moe=moe, attention_bias=True, qk_norm=True))
    params = jax.tree_util.tree_map(lambda a: a * 4.0 if a.ndim >= 2 else a,
                                    model.init_params(jax.random.key(1)))
    model, params = with_mtp(model, params, jax.random.key(2), depths=1)
    eye = jnp.concatenate([jnp.eye(32), jnp.zeros((32, 32))])[None]  # [1, 2H, H]
    params = {**params, "mtp": {**params["mtp"], "eh_proj": params["mtp"]["eh_proj"] + eye}}
    g = jaxgen.GenerationConfig
    base = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=63)
    cases = {"greedy": g(**base), "beam": g(**base, num_beams=2),
             "sampling": g(**base, do_sample=True, temperature=0.9),
             "use_mtp": g(**base, use_mtp=True)}
    checks = {}
    for name, cfg in cases.items():
        alone = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg,
                                                          jax.random.key(7)), cfg)
        for shape in ((4, 2), (1, 8)):
            mesh = jax.make_mesh(shape, ("data", "model"))
            state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(7), mesh=mesh)
            out = jaxgen.generate(shard(model, params, mesh), state, cfg)
            checks[f"{name} {shape}"] = bool(
                np.array_equal(np.asarray(out.sequences), np.asarray(alone.sequences))
                and np.array_equal(np.asarray(out.lengths), np.asarray(alone.lengths)))
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    placed = shard(model, params, mesh)
    spec = placed["layers"]["experts_gate"].sharding.spec  # [Lm, E, D, F]
    checks["experts split by expert"] = tuple(spec) == (None, "model", None, None)
    mtp_spec = placed["mtp"]["layers"]["experts_down"].sharding.spec  # [1, E, F, D]
    checks["mtp experts split by expert"] = tuple(mtp_spec) == (None, "model", None, None)
    shards = placed["layers"]["experts_gate"].addressable_shards
    checks["one expert per device"] = all(s.data.shape[1] == 1 for s in shards)
    print(json.dumps(checks))


if __name__ == "__main__":  # 8 simulated devices, set before JAX first touches a device
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    main()
