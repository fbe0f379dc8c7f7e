"""A Gemma 2 model on simulated 8-device CPU meshes: the same tokens as one device
(tests/test_gemma.py runs it in a subprocess and reads its last JSON line: check -> ok)."""
from __future__ import annotations

import json
import os


import jax
import numpy as np

import jaxgen
from jaxgen.models import Gemma, GemmaConfig
from jaxgen.models.param_sharding import shard

PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9, 8, 9, 8, 9], [3, 3, 3, 3, 3], [1],
           [2, 4, 2, 4], [6, 6, 1], [7, 1, 2, 7, 1]]


def main() -> None:
    model = Gemma(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                              num_heads=8, num_kv_heads=8, head_dim=8, sliding_window=3,
                              layer_types=("sliding_attention", "full_attention",
                                           "sliding_attention"),
                              attn_logit_softcapping=2.0, final_logit_softcapping=10.0))
    params = jax.tree_util.tree_map(lambda a: a * 4.0 if a.ndim >= 2 else a,
                                    model.init_params(jax.random.key(1)))
    g = jaxgen.GenerationConfig
    base = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=63)
    cases = {"greedy": g(**base), "beam": g(**base, num_beams=2),
             "sampling": g(**base, do_sample=True, temperature=0.9),
             "prompt_lookup": g(**base, prompt_lookup_num_tokens=2)}
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
    checks["wq on model"] = "model" in str(placed["layers"]["wq"].sharding.spec)
    print(json.dumps(checks))


if __name__ == "__main__":  # 8 simulated devices, set before JAX first touches a device
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    main()
