"""A Gemma 4 model (both layer types with their own head dims, per-layer inputs, KV-shared
layers, a double-wide MLP, attention_k_eq_v) and its assistant on simulated 8-device CPU
meshes: greedy, beam and the assistant's drafting give the same tokens as one device
(tests/test_gemma4.py runs it in a subprocess and reads its last JSON line: check -> ok)."""
from __future__ import annotations

import dataclasses
import json
import os


import jax
import jax.numpy as jnp
import numpy as np

import jaxgen
from jaxgen.models.gemma4 import Gemma4, Gemma4Config
from jaxgen.models.gemma4_assistant import Gemma4Assistant, Gemma4AssistantConfig
from jaxgen.models.param_sharding import shard

PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9, 8, 9, 8, 9], [3, 3, 3, 3, 3], [1],
           [2, 4, 2, 4], [6, 6, 1], [7, 1, 2, 7, 1]]
TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
SHAPES = dict(vocab_size=64, intermediate_size=16, num_heads=8, sliding_window=3,
              rope=(("full_attention", ("proportional", 1e6, 0.25, 1.0)),
                    ("sliding_attention", ("default", 1e4, 1.0, 1.0))))


def models():
    """(target, params, assistant pair): sizes the (1, 8) mesh's model axis divides."""
    model = Gemma4(Gemma4Config(
        hidden_size=32, layer_types=TYPES, head_dims=(4, 8, 4, 8), kv_heads=(8, 8, 8, 8),
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, num_kv_shared_layers=2,
        use_double_wide_mlp=True, attention_k_eq_v=True, final_logit_softcapping=10.0,
        **SHAPES))
    params = jax.tree_util.tree_map(lambda a: a * 4.0 if a.ndim >= 2 else a,
                                    model.init_params(jax.random.key(1)))
    assistant = Gemma4Assistant(Gemma4AssistantConfig(
        text=Gemma4Config(hidden_size=32, layer_types=TYPES[:2], head_dims=(4, 8),
                          kv_heads=(8, 8), **SHAPES), backbone_hidden_size=32))
    drafter_params = assistant.init_params(jax.random.key(3), scale=0.1)
    # the token's own embedding passes through to the target's embedding table: some drafts
    # are accepted, some rejected
    drafter_params["embed"] = params["embed"]
    eye = jnp.concatenate([jnp.eye(32), jnp.zeros((32, 32))])  # [2 Dt, D]
    drafter_params["pre_projection"] = drafter_params["pre_projection"] + eye
    return model, params, (assistant, drafter_params)


def main() -> None:
    model, params, (assistant, drafter_params) = models()
    g = jaxgen.GenerationConfig
    base = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=63)
    drafting = dict(max_new_tokens=10, pad_token_id=0, num_assistant_tokens=3,
                    num_assistant_tokens_schedule="constant", assistant_fallback=False,
                    assistant_confidence_threshold=0.0)
    cases = {"greedy": (g(**base), False), "beam": (g(**base, num_beams=2), False),
             "assistant": (g(**drafting), True),
             "assistant sampling": (g(**drafting, do_sample=True, temperature=0.9), True)}
    checks = {}
    for name, (cfg, drafts) in cases.items():
        extra = {"assistant_model": (assistant, drafter_params)} if drafts else {}
        alone = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg,
                                                          jax.random.key(7)), cfg, **extra)
        if drafts:
            drafted = int(np.sum(alone.speculative.drafted))
            accepted = int(np.sum(alone.speculative.accepted))
            checks[f"{name}: some drafts accepted, some rejected"] = 0 < accepted < drafted
        for shape in ((2, 4), (1, 8)):
            mesh = jax.make_mesh(shape, ("data", "model"))
            state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(7), mesh=mesh)
            if drafts:
                extra = {"assistant_model": (assistant, shard(assistant, drafter_params, mesh))}
            out = jaxgen.generate(shard(model, params, mesh), state, cfg, **extra)
            same = (np.array_equal(np.asarray(out.sequences), np.asarray(alone.sequences))
                    and np.array_equal(np.asarray(out.lengths), np.asarray(alone.lengths)))
            if drafts:
                same = same and all(np.array_equal(
                    np.asarray(getattr(out.speculative, field)),
                    np.asarray(getattr(alone.speculative, field)))
                    for field in ("drafted", "accepted"))
            checks[f"{name} {shape}"] = bool(same)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    placed = shard(model, params, mesh)
    specs = {f"{key} on model": placed["layers"][1][key] for key in ("wq", "wk", "wo",
                                                                       "w_down", "ple_gate")}
    specs.update({f"{key} on model": placed[key] for key in ("embed", "ple_embed",
                                                             "ple_projection")})
    specs["assistant wq on model"] = shard(assistant, drafter_params, mesh)["layers"][0]["wq"]
    checks.update({name: "model" in str(array.sharding.spec) for name, array in specs.items()})
    state = jaxgen.init_state(model, PROMPTS, g(**base), jax.random.key(7), mesh=mesh)
    checks["cache kv heads on model"] = all(
        "model" in str(group.k.sharding.spec) for group in state.cache.groups)
    narrow = jax.make_mesh((1, 8), ("data", "model"))
    wide_full = Gemma4(dataclasses.replace(model.config, kv_heads=(8, 4, 8, 4)))
    checks["full layers' kv heads refused"] = refused(
        lambda: shard(wide_full, wide_full.init_params(jax.random.key(0)), narrow),
        "num_global_key_value_heads")
    odd_mlp = Gemma4Assistant(dataclasses.replace(assistant.config, text=dataclasses.replace(
        assistant.config.text, intermediate_size=12)))
    checks["assistant's MLP width refused"] = refused(
        lambda: shard(odd_mlp, odd_mlp.init_params(jax.random.key(0)), narrow),
        "text_config.intermediate_size")
    print(json.dumps(checks))


def refused(call, field: str) -> bool:
    """Whether `call` raises a ValueError naming `field`."""
    try:
        call()
    except ValueError as error:
        return field in str(error)
    return False


if __name__ == "__main__":  # 8 simulated devices, set before JAX first touches a device
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    main()
