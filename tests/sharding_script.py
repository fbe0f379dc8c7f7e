"""Runs jaxgen on simulated CPU meshes and prints one JSON line of checks (tests/test_sharding.py).

Run in a subprocess: the device count must be set before JAX starts, and the rest of the
suite keeps one device. Every check compares a sharded run against the same call on one
device (token for token), or a property of the placement (specs, bytes per device, traces).

    python tests/sharding_script.py plain     # greedy, sampling, beam on meshes (1,8) (2,4)
                                              # (8,1); placements, bytes, traces, errors
    python tests/sharding_script.py assisted  # prompt lookup, early exit, on the same meshes
    python tests/sharding_script.py extra     # (2,4): draft model, every cache kind, drivers
    python tests/sharding_script.py guided    # (2,4): a token automaton (placement, tokens)
    python tests/sharding_script.py guided_all  # every mesh: the checkpoint's MTP layers,
                                              # guidance, constraints in every mode
    python tests/sharding_script.py smollm2   # SmolLM2 greedy on a (1,3) and an (8,1) mesh
    python tests/sharding_script.py multihost PROCESS PORT   # one of 2 processes (4 devices
                                              # each, jax.distributed over localhost)

The default suite runs "plain" and "assisted" side by side (two processes: two cores).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

import jax
import numpy as np

import jaxgen
from jaxgen.models import tiny_llama, unstack_layers
from jaxgen.models.exit_adapter import init_exit_adapter
from jaxgen.models.param_sharding import shard
from jaxgen.models.quantize import quantize_params

MESHES = ((1, 8), (2, 4), (8, 1))
CHECKS: dict[str, dict] = {}


def check(name: str, ok: bool, detail="") -> None:
    CHECKS[name] = {"ok": bool(ok), "detail": str(detail)[:600]}


def mesh_of(shape, devices=None):
    return jax.make_mesh(shape, ("data", "model"), devices=devices)


def peaked(params, scale=4.0):
    """Larger weights than init_params' 0.02: peaked logits, so no greedy choice is a near
    tie that a different summation order could flip."""
    return jax.tree_util.tree_map(lambda a: a * scale if a.ndim >= 2 else a, params)


def tiny_models():
    shapes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=16, num_kv_heads=8, head_dim=4)
    model, params = tiny_llama(seed=1, **shapes)
    params = peaked(params)
    adapter = init_exit_adapter(jax.random.key(5), hidden=32, width=16)
    adapter["w_out"] = 0.1 * jax.random.normal(jax.random.key(6), (16, 32))
    with_adapter = dict(params, exit_adapters={"1": adapter})
    draft, draft_params = tiny_llama(seed=2, **dict(shapes, num_layers=1, num_heads=8))
    return model, params, with_adapter, draft, peaked(draft_params)


PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [9, 8, 9, 8, 9], [3, 3, 3, 3, 3], [1],
           [2, 4, 2, 4], [6, 6, 1], [7, 1, 2, 7, 1]]
OTHER_PROMPTS = [[4, 3, 2, 1], [8, 8], [1, 2], [5], [6, 5, 4], [2, 2, 2], [9], [3, 1]]


def run(model, params, cfg, mesh, prompts=PROMPTS, key=7, constraint=None, **generate_kwargs):
    """The output of one generate call; params sharded here. constraint: init_state's."""
    placed = params if mesh is None else shard(model, params, mesh)
    if "assistant_model" in generate_kwargs and mesh is not None:
        draft, draft_params = generate_kwargs["assistant_model"]
        generate_kwargs = dict(generate_kwargs,
                               assistant_model=(draft, shard(draft, draft_params, mesh)))
    state = jaxgen.init_state(model, prompts, cfg, jax.random.key(key), mesh=mesh,
                              constraint=constraint)
    return jaxgen.generate(placed, state, cfg, **generate_kwargs)


def same_tokens(a, b) -> tuple[bool, str]:
    sa, sb = np.asarray(a.sequences), np.asarray(b.sequences)
    la, lb = np.asarray(a.lengths), np.asarray(b.lengths)
    ok = sa.shape == sb.shape and np.array_equal(sa, sb) and np.array_equal(la, lb)
    return ok, "" if ok else f"one device {sb.tolist()} vs sharded {sa.tolist()}"


BASE = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=63)


def plain_cases(model, params, with_adapter):
    """name -> (params, cfg): greedy, sampling and beam search."""
    g = jaxgen.GenerationConfig
    return {"greedy": (params, g(**BASE)),
            "sampling": (params, g(**BASE, do_sample=True, temperature=0.9, top_p=0.9)),
            "beam": (params, g(**BASE, num_beams=2, num_return_sequences=2))}


def assisted_cases(model, params, with_adapter):
    """name -> (params, cfg): assisted decoding (K = 1 keeps the programs small); early exit
    on the unstacked layout with an exit adapter in the params."""
    g = jaxgen.GenerationConfig
    # the plain-step fallback would stop a random model's failing lookups: keep them drafting
    return {"prompt_lookup": (params, g(**BASE, prompt_lookup_num_tokens=1,
                                        assistant_fallback=False)),
            "early_exit_unstacked_sampling": (
                unstack_layers(model, with_adapter),
                g(**BASE, do_sample=True, assistant_early_exit=1, num_assistant_tokens=1))}


def compare_on_meshes(cases) -> None:
    """Every case on one device, then on each mesh: same tokens, one compile per mesh."""
    model, params, with_adapter, _, _ = tiny_models()
    cases = cases(model, params, with_adapter)
    reference = {name: run(model, p, cfg, None) for name, (p, cfg) in cases.items()}
    for name, out in reference.items():
        if out.speculative is not None:
            check(f"{name} drafts on one device", int(np.asarray(
                out.speculative.drafted).sum()) > 0, out.speculative.drafted)
    for shape in MESHES:
        mesh = mesh_of(shape)
        for name, (p, cfg) in cases.items():
            before = jaxgen.trace_count()
            out = run(model, p, cfg, mesh)
            check(f"{shape} {name} tokens", *same_tokens(out, reference[name]))
            check(f"{shape} {name} compiled once", jaxgen.trace_count() - before == 1,
                  jaxgen.trace_count() - before)


def plain() -> None:
    compare_on_meshes(plain_cases)
    model, params, _, _, _ = tiny_models()
    cfg = plain_cases(model, params, None)["greedy"][1]
    reference = run(model, params, cfg, None, prompts=OTHER_PROMPTS, key=11)
    for shape in MESHES:
        mesh = mesh_of(shape)
        placement_checks(model, params, mesh, shape, cfg)
        # compile once per mesh: new prompts of the same bucket and new keys reuse it
        before = jaxgen.trace_count()
        out = run(model, params, cfg, mesh, prompts=OTHER_PROMPTS, key=11)
        check(f"{shape} greedy new prompts reuse the program", jaxgen.trace_count() == before,
              jaxgen.trace_count() - before)
        check(f"{shape} greedy new prompts tokens", *same_tokens(out, reference))
    quantized_checks(model, params, cfg)
    error_checks(model, params)


def quantized_checks(model, params, cfg) -> None:
    """int8 weights (an Int8Matrix per matrix) on the (2, 4) mesh: codes split like the float
    matrix, a scale too small to split stays whole, one device's tokens."""
    quantized = quantize_params(model.config, params)
    mesh = mesh_of((2, 4))
    placed = shard(model, quantized, mesh)
    wq, wo = placed["layers"]["wq"], placed["layers"]["wo"]
    check("int8 wq codes on model", tuple(wq.codes.sharding.spec)[-1] == "model",
          wq.codes.sharding)
    check("int8 wo codes rows on model, its [L, 1, N] scale whole",
          tuple(wo.codes.sharding.spec)[-2] == "model"
          and shard_bytes(wo.scale) == wo.scale.nbytes, (wo.codes.sharding, wo.scale.sharding))
    check("int8 tokens on the (2, 4) mesh", *same_tokens(run(model, quantized, cfg, mesh),
                                                        run(model, quantized, cfg, None)))


def assisted() -> None:
    compare_on_meshes(assisted_cases)


def extra() -> None:
    model, params, _, draft, draft_params = tiny_models()
    more_cases(model, params, draft, draft_params, mesh_of((2, 4)))


def guided_cases(model, params, shapes):
    """name -> (model, params, cfg, generate kwargs, init_state kwargs): the checkpoint's MTP
    layers (use_mtp), classifier-free guidance and a compiled token automaton."""
    from jaxgen.constraints.automaton import from_edges
    from jaxgen.models.mtp import with_mtp
    mtp_model, mtp_params = with_mtp(model, params, jax.random.key(3), depths=2)
    mtp_params["mtp"] = peaked(mtp_params["mtp"])
    automaton = from_edges({0: {5: 1, 6: 1}, 1: {7: 2, 8: 0}}, initial=0, finals=[2],
                           vocab_size=model.vocab_size)
    g = jaxgen.GenerationConfig
    negative = dict(negative_prompt_ids=[[3, 4]] * len(PROMPTS))
    cases = {"constraint greedy": (model, params, g(**BASE), {}, dict(constraint=automaton))}
    if shapes != "default":  # the slow set: MTP's programs alone compile for ~30 s
        cases.update({
            "mtp greedy": (mtp_model, mtp_params, g(**BASE, use_mtp=True), {}, {}),
            "guidance greedy": (model, params, g(**BASE, guidance_scale=2.0), negative, {}),
            "mtp sampling K=3": (mtp_model, mtp_params, g(**BASE, use_mtp=True, do_sample=True,
                                                          num_assistant_tokens=3), {}, {}),
            "guidance sampling": (model, params, g(**BASE, guidance_scale=1.5, do_sample=True),
                                  {}, {}),
            "constraint sampling": (model, params, g(**BASE, do_sample=True), {},
                                    dict(constraint=automaton)),
            "constraint beam": (model, params, g(**BASE, num_beams=2), {},
                                dict(constraint=automaton)),
            "constraint prompt lookup": (model, params, g(**BASE, prompt_lookup_num_tokens=2),
                                         {}, dict(constraint=automaton)),
            "prefix_allowed_tokens_fn": (model, params, g(**BASE),
                                         dict(prefix_allowed_tokens_fn=_alternate), {})})
    return cases


def _alternate(batch_id, ids):
    """A prefix_allowed_tokens_fn: two alphabets by the parity of the length."""
    return [5, 6, 7, 63] if len(ids) % 2 else [8, 9, 63]


def guided(which: str = "default") -> None:
    """MTP layers, classifier-free guidance and constraints on a mesh: one device's tokens,
    one compile per mesh, and what each keeps of its own is split over the mesh."""
    model, params, _, _, _ = tiny_models()
    cases = guided_cases(model, params, which)
    for name, (m, p, cfg, kw, init_kw) in cases.items():
        reference = run(m, p, cfg, None, **kw, **init_kw)
        # greedy on every mesh of the slow set; the other modes on (2, 4), both axes split
        meshes = MESHES if which != "default" and name.endswith("greedy") else ((2, 4),)
        for shape in meshes:
            mesh = mesh_of(shape)
            before = jaxgen.trace_count()
            try:
                out = run(m, p, cfg, mesh, **kw, **init_kw)
            except Exception:
                check(f"{shape} {name} tokens", False, traceback.format_exc()[-600:])
                continue
            check(f"{shape} {name} tokens", *same_tokens(out, reference))
            programs = 2 if "prefix_allowed_tokens_fn" in kw else 1  # start + advance
            check(f"{shape} {name} compiled once", jaxgen.trace_count() - before == programs,
                  jaxgen.trace_count() - before)
            data, parallel = shape
            if out.state is not None:  # beam search's output holds no state
                k = out.state.cache.k
                check(f"{shape} {name} cache bytes per device",
                      shard_bytes(k) * data * parallel == k.nbytes, k.sharding)
            if name.startswith("mtp"):
                mtp_placement(m, p, mesh, out, shape)
            if "constraint" in init_kw and out.state is not None:
                carry, placed = out.state.constraint, jaxgen.cache.check_mesh(mesh)
                whole = jax.sharding.NamedSharding(placed, jax.sharding.PartitionSpec())
                rows = jax.sharding.NamedSharding(placed, jax.sharding.PartitionSpec("data"))
                check(f"{shape} {name} automaton whole, row states on data",
                      carry.automaton.allowed.sharding.is_equivalent_to(whole, 2)
                      and carry.state.sharding.is_equivalent_to(rows, 1),
                      (carry.automaton.allowed.sharding, carry.state.sharding))


def mtp_placement(model, params, mesh, out, shape) -> None:
    """params["mtp"]'s blocks in the Megatron layout; the depths' caches split like the
    target's (rows on "data", KV heads on "model")."""
    data, parallel = shape
    placed = shard(model, params, mesh)["mtp"]
    wq, wo, norm = placed["layers"]["wq"], placed["layers"]["wo"], placed["enorm"]
    check(f"{shape} mtp blocks tensor parallel",
          tuple(wq.sharding.spec) == (None, None, "model")
          and tuple(wo.sharding.spec) == (None, "model", None)
          and shard_bytes(wq) * parallel == wq.nbytes and shard_bytes(norm) == norm.nbytes,
          (wq.sharding, wo.sharding, norm.sharding))
    cache, last = out.state.spec.draft_state
    check(f"{shape} mtp depth caches split like the target's",
          shard_bytes(cache.k) * data * parallel == cache.k.nbytes
          and shard_bytes(last) * data == last.nbytes, (cache.k.sharding, last.sharding))


def shard_bytes(array) -> int:
    return array.addressable_shards[0].data.nbytes


def placement_checks(model, params, mesh, shape, cfg) -> None:
    data, parallel = shape
    placed = shard(model, params, mesh)
    layers = placed["layers"]
    specs = {name: tuple(layers[name].sharding.spec) for name in ("wq", "wk", "wo", "w_up",
                                                                   "w_down", "attn_norm")}
    want = {"wq": (None, None, "model"), "wk": (None, None, "model"),
            "wo": (None, "model", None), "w_up": (None, None, "model"),
            "w_down": (None, "model", None), "attn_norm": ()}
    check(f"{shape} parameter specs", all(specs[k][:len(want[k])] == want[k]
                                          and all(s is None for s in specs[k][len(want[k]):])
                                          for k in want), specs)
    check(f"{shape} lm_head vocabulary parallel",
          tuple(placed["lm_head"].sharding.spec) in ((None, "model"),), placed["lm_head"].sharding)
    for name in ("wq", "w_down"):
        check(f"{shape} {name} bytes per device", shard_bytes(layers[name]) * parallel
              == layers[name].nbytes, (shard_bytes(layers[name]), layers[name].nbytes))
    check(f"{shape} norm replicated", shard_bytes(layers["attn_norm"])
          == layers["attn_norm"].nbytes)
    state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(0), mesh=mesh)
    k = state.cache.k
    check(f"{shape} cache spec", tuple(k.sharding.spec)[:3] == (None, "data", "model")
          or (tuple(k.sharding.spec)[:3] == (None, "data", None) and parallel == 1)
          or (tuple(k.sharding.spec)[:3] == (None, None, "model") and data == 1), k.sharding)
    check(f"{shape} cache bytes per device", shard_bytes(k) * data * parallel == k.nbytes,
          (shard_bytes(k), k.nbytes))
    check(f"{shape} tokens bytes per device", shard_bytes(state.tokens) * data
          == state.tokens.nbytes, (shard_bytes(state.tokens), state.tokens.nbytes))
    spec_in = state.cache.k.sharding
    out = jaxgen.generate(placed, state, cfg)
    check(f"{shape} output cache keeps its sharding",
          out.state.cache.k.sharding.is_equivalent_to(spec_in, k.ndim), out.state.cache.k.sharding)
    check(f"{shape} sequences rows on data",
          out.sequences.sharding.is_equivalent_to(jax.sharding.NamedSharding(
              jaxgen.cache.check_mesh(mesh), jax.sharding.PartitionSpec("data")), 2),
          out.sequences.sharding)


def more_cases(model, params, draft, draft_params, mesh) -> None:
    """On the (2, 4) mesh: a draft model, every cache kind, the chunked / growing drivers."""
    shape = (2, 4)
    base = BASE
    g = jaxgen.GenerationConfig
    sliding = type(model)(dataclasses.replace(model.config, sliding_window=4))
    cases = {
        "draft_model": (model, params, g(**base, do_sample=True, num_assistant_tokens=3),
                        dict(assistant_model=(draft, draft_params))),
        "quantized cache": (model, params, g(**base, cache_implementation="quantized",
                                             cache_config={"residual_length": 2}), {}),
        "sliding_window cache": (sliding, params, g(**base, cache_implementation="sliding_window"),
                                 {}),
        "offloaded cache (host memory)": (model, params, g(**base, cache_implementation="offloaded",
                                                           cache_config={"offload_on_cpu": True}),
                                          {}),
        "dynamic cache (growing driver)": (model, params, g(**base, cache_implementation="dynamic",
                                                            cache_config={"initial_length": 8,
                                                                          "chunk_size": 4}), {}),
        "streamed (chunked driver)": (model, params, g(**base), dict(stop_event=_NeverSet())),
    }
    for name, (m, p, cfg, kw) in cases.items():
        try:
            reference = run(m, p, cfg, None, **kw)
            out = run(m, p, cfg, mesh, **kw)
            check(f"{shape} {name} tokens", *same_tokens(out, reference))
            cache = out.state.cache
            leaf = next(x for x in jax.tree_util.tree_leaves(cache) if x.ndim == 5)
            check(f"{shape} {name} cache sharded", shard_bytes(leaf) * 8 == leaf.nbytes,
                  leaf.sharding)
        except Exception:
            check(f"{shape} {name} tokens", False, traceback.format_exc()[-600:])


class _NeverSet:
    """A stop_event that never fires: the chunked driver, with identical tokens."""

    def is_set(self) -> bool:
        return False


def expect_error(name: str, fn, *needles) -> None:
    try:
        fn()
    except ValueError as error:
        text = str(error)
        check(name, all(n in text for n in needles), text)
        return
    except Exception as error:  # noqa: BLE001 - reported as a failed check
        check(name, False, f"{type(error).__name__}: {error}")
        return
    check(name, False, "no error raised")


def error_checks(model, params) -> None:
    odd, odd_params = tiny_llama(num_heads=6, num_kv_heads=2, head_dim=4, hidden_size=24,
                                 intermediate_size=48)
    expect_error("heads not divisible names the sizes",
                 lambda: shard(odd, odd_params, mesh_of((1, 8))), "num_heads (6)", "8 devices")
    kv, kv_params = tiny_llama(num_heads=8, num_kv_heads=2, head_dim=4, hidden_size=32,
                               intermediate_size=64)
    expect_error("kv heads not divisible names the sizes",
                 lambda: shard(kv, kv_params, mesh_of((1, 8))), "num_kv_heads (2)", "8 devices")
    cfg = jaxgen.GenerationConfig(max_new_tokens=2)
    expect_error("batch not divisible names the sizes",
                 lambda: jaxgen.init_state(model, PROMPTS[:3], cfg, mesh=mesh_of((2, 4))),
                 "batch", "(3)", "'data'", "2 devices")
    expect_error("cache kv heads not divisible",
                 lambda: jaxgen.init_state(kv, PROMPTS, cfg, mesh=mesh_of((1, 8))),
                 "KV heads (2)", "8 devices")
    expect_error("mesh axis names are checked",
                 lambda: shard(model, params, jax.make_mesh((2, 4), ("x", "y"))), "'data'",
                 "'model'")
    wide, wide_params = tiny_llama(vocab_size=60, num_heads=8, num_kv_heads=8, head_dim=4,
                                   hidden_size=32, intermediate_size=64)
    placed = shard(wide, wide_params, mesh_of((1, 8)))
    check("vocabulary 60 on 8 devices: head replicated",
          tuple(placed["lm_head"].sharding.spec) in ((), (None, None)), placed["lm_head"].sharding)
    expect_error("head='vocab' that cannot split names the sizes",
                 lambda: shard(wide, wide_params, mesh_of((1, 8)), head="vocab"),
                 "vocab_size (60)")


def smollm2() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads): tensor parallel on 3 devices, data parallel on 8."""
    from jaxgen.models import DEFAULT_MODEL, load
    model, params, tokenizer = load(DEFAULT_MODEL)
    prompts = [tokenizer.encode(text) for text in (
        "The capital of France is", "def fibonacci(n):", "Once upon a time",
        "The three primary colors are", "Water boils at", "import numpy as np",
        "The largest planet is", "My favourite food is")]
    cfg = jaxgen.default_config(model, max_new_tokens=8)
    reference = run(model, params, cfg, None, prompts=prompts)
    for shape, devices in (((1, 3), jax.devices()[:3]), ((8, 1), None)):
        out = run(model, params, cfg, mesh_of(shape, devices), prompts=prompts)
        check(f"smollm2 {shape} greedy tokens", *same_tokens(out, reference))


def multihost() -> None:
    """One of two processes: a (2, 4) mesh whose "data" rows live on different processes.
    Global prompts on every process, and process-local prompts (4 rows each) assembled into
    one batch, give the tokens of one device; each process holds only its own rows."""
    from jax.experimental import multihost_utils
    process = int(sys.argv[2])
    check("2 processes, 8 global devices", (jax.process_count(), len(jax.devices()),
                                            len(jax.local_devices())) == (2, 8, 4))
    model, params, _, _, _ = tiny_models()
    mesh = mesh_of((2, 4))
    placed = shard(model, params, mesh)
    g = jaxgen.GenerationConfig
    for name, cfg in (("greedy", g(**BASE)), ("sampling", g(**BASE, do_sample=True))):
        reference = run(model, params, cfg, None)  # this process's own device, whole batch
        want = np.asarray(reference.sequences)
        state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(7), mesh=mesh)
        out = jaxgen.generate(placed, state, cfg)
        got = np.asarray(multihost_utils.process_allgather(out.sequences, tiled=True))
        check(f"multihost {name} global prompts", np.array_equal(got, want),
              (got.tolist(), want.tolist()))
        mine = PROMPTS[4 * process:4 * process + 4]
        state = jaxgen.init_state(model, mine, cfg, jax.random.key(7), mesh=mesh,
                                  process_local=True)
        out = jaxgen.generate(placed, state, cfg)
        got = np.asarray(multihost_utils.process_allgather(out.sequences, tiled=True))
        check(f"multihost {name} process-local prompts", np.array_equal(got, want),
              (got.tolist(), want.tolist()))
        local = np.concatenate([np.asarray(shard.data) for shard in sorted(
            out.sequences.addressable_shards, key=lambda sh: sh.index[0].start or 0)
            if shard.replica_id == 0])
        check(f"multihost {name} this process holds its own rows",
              not out.sequences.is_fully_addressable
              and np.array_equal(local, want[4 * process:4 * process + 4]), local.tolist())


def start_distributed() -> None:
    """jax.distributed.initialize, before anything touches a device: the coordinator is
    process 0 on localhost; CPU collectives between the processes go through gloo."""
    process, port = int(sys.argv[2]), int(sys.argv[3])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process)


def simulate_devices(count: int) -> None:
    """XLA_FLAGS for `count` CPU devices; read when JAX first touches a device (imports of
    jax / jaxgen above touch none)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={count}").strip()


def main() -> None:
    start = time.perf_counter()
    devices = 4 if sys.argv[1] == "multihost" else 8  # multihost: 2 processes x 4 devices
    simulate_devices(devices)
    if sys.argv[1] == "multihost":
        start_distributed()
    check(f"{devices} devices", len(jax.local_devices()) == devices, jax.local_devices())
    {"plain": plain, "assisted": assisted, "extra": extra, "smollm2": smollm2,
     "multihost": multihost, "guided": guided,
     "guided_all": lambda: guided("all")}[sys.argv[1]]()
    print(json.dumps({"checks": CHECKS, "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
