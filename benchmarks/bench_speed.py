"""Decode speed against the floors and the peers: jaxgen as `load()` returns it (stacked layers,
split per call on CPU), the stacked scan kept (generate(..., layout="portable")), after
`unstack_layers`, with int8 weights (`load(weights="int8")`), with the GGUF file's own Q4_1 /
Q8_0 blocks (`load(weights="gguf")`), transformers (torch CPU, fp32,
same weights) and llama.cpp (llama-cpp-python, when installed: the shipped Q4_1 GGUF and
an F32 GGUF written from the same weights), batch 1 and 8, plus a per-piece profile of one
decode step. Everything in one run; medians of repeats; ratios within the run. The jaxgen
rows that run the default settings and the llama.cpp rows are timed in turns (one call of
each per repeat).

    python benchmarks/bench_speed.py [--new-tokens 128] [--repeats 5] [--batches 1 8]
    python benchmarks/bench_speed.py --profile-only      # the per-piece breakdown only
    python benchmarks/bench_speed.py --isa avx2          # every system held to AVX2

Floors: bandwidth floor = bytes of weights read per decode step / measured bandwidth (a
jitted fp32 matrix-vector product over 512 MB, as bench_generate.py); compute floor = 2 x
matmul parameters x batch / measured fp32 matmul FLOP/s (a 2048^3 jitted matmul).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_generate import measure_bandwidth, prompts_of
from host_isa import add_isa_argument, isa_line, restart_for_isa
from report_table import table_header, table_row

import jaxgen
from jaxgen.cache.layer_forms import to_layer_tuples
from jaxgen.core.step import choose, forward_last, state_context
from jaxgen.models import DEFAULT_MODEL, load, unstack_layers
from jaxgen.models.quantize import quantize_params
from jaxgen.runtime import compiled


def measure_matmul_flops(repeats: int = 5) -> float:
    """FLOP/s of a jitted fp32 2048 x 2048 x 2048 matmul (the best of `repeats`)."""
    a = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    best = min(_timed(lambda: mm(a).block_until_ready()) for _ in range(repeats))
    return 2 * 2048 ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_bytes(model, params) -> int:
    """Bytes of weights a decode step reads: every layer matrix and norm, the head, one row
    of the embeddings."""
    leaves = jax.tree_util.tree_leaves(params["layers"])
    head = params.get("lm_head", params["embed"])
    head_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(head))
    return sum(leaf.nbytes for leaf in leaves) + head_bytes + params["final_norm"].nbytes


def matmul_params(model) -> int:
    cfg = model.config
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (2 * qd + 2 * kd) + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size


# --------------------------------------------------------------------------- systems
def jaxgen_ms_per_token(model, params, prompts, new_tokens, repeats,
                        layout: str = "auto", kernels: str = "auto") -> tuple[float, float]:
    """(median seconds per decode step over the whole call, first-call compile seconds), with
    generate(..., layout=`layout`) (jaxgen.runtime.backend.LAYOUTS) and $JAXGEN_CPU_KERNELS =
    `kernels` while the program is traced (compiled programs are dropped first: the kernel
    setting is not part of jit's own cache key; the layout is a static argument)."""
    cfg = jaxgen.GenerationConfig(max_new_tokens=new_tokens, pad_token_id=0)  # no EOS
    run = lambda: jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg),  # noqa: E731
                                  cfg, layout=layout).sequences.block_until_ready()
    jax.clear_caches()
    kernels_before = os.environ.get("JAXGEN_CPU_KERNELS")
    os.environ["JAXGEN_CPU_KERNELS"] = kernels
    try:
        first = _timed(run)
        run()  # a second call: the kept layout is placed (huge pages) in the background
        compiled.wait_for_placement()
        times = [_timed(run) for _ in range(repeats)]
    finally:
        if kernels_before is None:
            os.environ.pop("JAXGEN_CPU_KERNELS", None)
        else:
            os.environ["JAXGEN_CPU_KERNELS"] = kernels_before
    jax.clear_caches()
    return float(np.median(times)) / new_tokens, first - float(np.median(times))


def jaxgen_interleaved_ms_per_token(model, params_by_name: dict, prompts, new_tokens,
                                    repeats, peers: dict | None = None) -> dict:
    """{name: (median seconds per decode step, first-call compile seconds)} for params that all
    run the default settings (layout="auto"), timed in turns (each repeat times every entry
    once, after two untimed calls that lay its params out again and place them as a process
    that calls more than once reads them: `jaxgen.runtime.compiled._laid_out`), so a host's
    drift hits them alike. `peers`
    ({name: a function that decodes `new_tokens` tokens and returns its seconds}, e.g.
    `llama_cpp_generation`) take their turns in the same repeats (compile seconds None)."""
    cfg = jaxgen.GenerationConfig(max_new_tokens=new_tokens, pad_token_id=0)  # no EOS
    runs = {name: (lambda p=p: jaxgen.generate(p, jaxgen.init_state(model, prompts, cfg), cfg,
                                                layout="auto").sequences.block_until_ready())
            for name, p in params_by_name.items()}
    peers = peers or {}
    jax.clear_caches()
    first = {name: _timed(run) for name, run in runs.items()}
    for peer in peers.values():
        peer()  # warm-up
    times = {name: [] for name in [*runs, *peers]}
    for _ in range(repeats):
        for name, run in runs.items():
            run()  # the params laid out again (one layout is kept at a time)
            run()  # ... and placed (huge pages) in the background
            compiled.wait_for_placement()
            times[name].append(_timed(run))
        for name, peer in peers.items():
            times[name].append(peer())
    jax.clear_caches()
    return {name: (float(np.median(t)) / new_tokens,
                   first[name] - float(np.median(t)) if name in first else None)
            for name, t in times.items()}


def transformers_ms_per_token(hf, prompts, new_tokens, repeats) -> float:
    import torch

    ids = torch.tensor(prompts)
    hf.generation_config.eos_token_id = None
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        times = [_timed(lambda: hf.generate(ids, **kwargs)) for _ in range(repeats)]
    return float(np.median(times)) / new_tokens


def write_f32_gguf(source: str, target: str) -> str:
    """The shipped GGUF with every tensor dequantized to F32 (same metadata)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = [bytes(field.parts[i]).decode() if sub == gguf.GGUFValueType.STRING
                      else field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(field.name, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], kind)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape(tuple(reversed(
            [int(d) for d in tensor.shape]))), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def llama_cpp_generation(path, prompt, new_tokens, threads):
    """A function that runs llama.cpp greedy decoding of `new_tokens` tokens (EOS ignored) at
    batch 1 from `prompt` and returns its seconds (the model loaded once, here)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=len(prompt) + new_tokens + 8, n_threads=threads,
                n_batch=64, verbose=False)

    def run():
        start = time.perf_counter()
        llm.reset()
        for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0), start=1):
            if count == new_tokens:
                break
        return time.perf_counter() - start

    return run


def llama_cpp_forward_seconds(path, widths, position: int = 128, threads: int = 2,
                              repeats: int = 7) -> dict:
    """{width: median seconds of one llama.cpp batch-1 forward of `width` tokens with logits
    at every one of them (a verify forward), against a cache holding `position` tokens}."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=position + max(widths) + 8, n_threads=threads,
                n_batch=max(64, max(widths)), logits_all=True, verbose=False)
    llm.eval(list(range(100, 100 + position)))

    def forward(width):
        llm.n_tokens = position  # back to the prefix; the next eval overwrites the rest
        llm.eval(list(range(200, 200 + width)))

    times = {width: [] for width in widths}
    for _ in range(repeats):  # interleaved, so load changes touch every width alike
        for width in widths:
            times[width].append(_timed(lambda: forward(width)))
    return {width: float(np.median(values)) for width, values in times.items()}


def llama_cpp_f32_forward_seconds(widths, position: int = 128,
                                  repeats: int = 7) -> dict | None:
    """`llama_cpp_forward_seconds` on an F32 GGUF written from the default model's weights
    (2 threads), or None (with a printed note) without llama-cpp-python."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama_cpp is not installed: no llama.cpp figures")
        return None
    from jaxgen.models.embedded import embedded_path

    with tempfile.TemporaryDirectory() as folder:
        path = write_f32_gguf(embedded_path(DEFAULT_MODEL), os.path.join(folder, "f32.gguf"))
        return llama_cpp_forward_seconds(path, widths, position=position, threads=2,
                                         repeats=repeats)


# --------------------------------------------------------------------------- profile
def profile_pieces(model, params, batch: int, steps: int = 32, repeats: int = 5) -> dict:
    """Milliseconds per decode step of each piece, each run `steps` times inside one jitted
    fori_loop (a data dependence keeps every iteration): the whole step, the forward
    (layers + head), the layers, the head, the weight matmuls alone, the cache write +
    attention, and choose (processors + argmax) with the log-probabilities."""
    cfg = model.config
    context = 96
    cache = model.init_cache(batch, context + steps + 1)
    tokens = jnp.ones((batch, context + steps + 1), jnp.int32)
    length = jnp.full((batch,), context, jnp.int32)
    x0 = jnp.ones((batch, 1, cfg.hidden_size), jnp.float32) * 0.01
    gcfg = jaxgen.GenerationConfig(max_new_tokens=steps)
    layers = params["layers"]
    per_layer = layers if isinstance(layers, (list, tuple)) else [
        jax.tree_util.tree_map(lambda a, i=i: a[i], layers) for i in range(cfg.num_layers)]

    def loop(body, carry):
        return jax.jit(lambda p, c: jax.lax.fori_loop(0, steps, lambda i, c: body(p, i, c), c))

    def forward(p, i, c):
        cache, toks = c
        logits, cache = forward_last(model, p, toks, length + i, cache)
        return cache, toks.at[:, 0].set(jnp.argmax(logits, -1).astype(jnp.int32))

    def step(p, i, c):
        cache, toks = c
        logits, cache = forward_last(model, p, toks, length + i, cache)
        ctx = state_context(_FakeState(toks, length + i))
        scores, chosen = choose(gcfg, logits, ctx, None)
        logp = jax.nn.log_softmax(scores, -1)[jnp.arange(batch), chosen]
        return cache, toks.at[:, 0].set(chosen + (logp > 1e9).astype(jnp.int32))

    def layers_only(p, i, c):
        cache, x = c
        pos = (length + i)[:, None]
        x, cache = model.run_layers(p, x, pos, cache, 0, cfg.num_layers)
        return cache, x * 0.5

    def head_only(p, i, x):
        logits = model.head(p, x)
        return x + logits[:, :, :cfg.hidden_size] * 1e-9

    def matmuls_only(p, i, x):
        h = x[:, 0]
        for lp in p:
            for key in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
                w = lp[key]
                k = w.shape[0]
                h = h + jnp.sum(jnp.pad(h, ((0, 0), (0, max(k - h.shape[1], 0))))[:, :k] @ w
                                ) * 1e-9
        return h[:, None]

    def attend_only(p, i, c):
        cache, x = c
        pos = (length + i)[:, None]
        q = jnp.broadcast_to(x[:, :, :1, None], (batch, 1, cfg.num_heads, cfg.head_dim))
        kv = q[:, :, :cfg.num_kv_heads]
        for layer in range(cfg.num_layers):
            out, cache = cache.update_attend(layer, q, kv, kv, pos, scale=0.125)
            q = q + out * 1e-3
        return cache, x + q[:, :, :1, 0] * 1e-3

    def choose_only(p, i, c):
        logits, toks = c
        ctx = state_context(_FakeState(toks, length + i))
        scores, chosen = choose(gcfg, logits, ctx, None)
        logp = jax.nn.log_softmax(scores, -1)[jnp.arange(batch), chosen]
        return logits + logp[:, None] * 1e-9, toks.at[:, 0].set(chosen)

    logits0 = jax.random.normal(jax.random.key(0), (batch, cfg.vocab_size))
    pieces = {
        "step (forward + choose)": (step, params, (cache, tokens)),
        "forward (layers + head)": (forward, params, (cache, tokens)),
        "layers": (layers_only, params, (cache, x0)),
        "head (norm + 49152x576)": (head_only, params, x0),
        "weight matmuls only": (matmuls_only, per_layer, x0),
        "cache write + attention": (attend_only, params, (to_layer_tuples(cache), x0)),  # as generate
        "choose + logprobs": (choose_only, params, (logits0, tokens)),
    }
    out = {}
    for name, (body, p, carry) in pieces.items():
        fn = loop(body, carry)
        jax.block_until_ready(fn(p, carry))
        times = [_timed(lambda: jax.block_until_ready(fn(p, carry))) for _ in range(repeats)]
        out[name] = float(np.median(times)) / steps * 1e3
    return out


class _FakeState:
    """The fields state_context reads."""

    def __init__(self, tokens, length):
        self.tokens, self.length = tokens, length
        self.prompt_len = jnp.zeros_like(length)
        self.max_new = jnp.full_like(length, 1 << 20)


# --------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--profile-only", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--layouts", default="012345",
                        help="which jaxgen rows: 0 load() as it is, 1 stacked scan, "
                             "2 unstacked, 3 int8, 4 int8 unstacked, 5 GGUF blocks, "
                             "6 int8 and 7 GGUF blocks with the native kernels off (XLA "
                             "expands the codes in memory), 8 fp32 with the kernels off "
                             "(XLA's own products)")
    add_isa_argument(parser)
    args = parser.parse_args()
    restart_for_isa(args.isa)

    model, stacked, tokenizer = load(DEFAULT_MODEL)
    unstacked = unstack_layers(model, stacked)
    int8 = quantize_params(model.config, stacked)
    blocks = load(DEFAULT_MODEL, weights="gguf")[1]  # the file's Q4_1 layers, Q8_0 head
    blocks_bytes = step_bytes(model, blocks)
    layouts = {"jaxgen load() as it is (split per call)": (stacked, "auto"),
               "jaxgen stacked scan (layout=portable)": (stacked, "portable"),
               "jaxgen unstack_layers": (unstacked, "auto"),
               "jaxgen int8 (split per call)": (int8, "auto"),
               "jaxgen int8 unstacked": (quantize_params(model.config, unstacked), "auto"),
               "jaxgen GGUF Q4_1 blocks (split per call)": (blocks, "auto"),
               "jaxgen int8, kernels off": (int8, "auto", "off"),
               "jaxgen GGUF Q4_1 blocks, kernels off": (blocks, "auto", "off"),
               "jaxgen fp32, kernels off": (stacked, "auto", "off")}
    layouts = {name: entry for index, (name, entry) in enumerate(layouts.items())
               if str(index) in args.layouts}
    bandwidth = measure_bandwidth()
    flops = measure_matmul_flops()
    fp32_bytes = step_bytes(model, stacked)
    print(f"\nSmolLM2-135M-Instruct, greedy, {args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} new tokens; bandwidth {bandwidth:.1f} GB/s, fp32 matmul "
          f"{flops / 1e9:.0f} GFLOP/s; weights read per step: fp32 {fp32_bytes / 1e6:.0f} MB, "
          f"int8 {step_bytes(model, int8) / 1e6:.0f} MB, GGUF blocks "
          f"{blocks_bytes / 1e6:.0f} MB; jax {jax.__version__}\n")

    if not args.no_profile:
        for batch in args.batches:
            floor = fp32_bytes / (bandwidth * 1e9) * 1e3
            print(f"\nProfile, batch {batch}, ms per decode step (median of repeats); fp32 "
                  f"bandwidth floor {floor:.2f} ms:\n")
            for index, (name, (p, *_)) in enumerate(layouts.items()):
                result = profile_pieces(model, p, batch)  # forward_last as given: no split
                if index == 0:
                    print(table_header("layout", *result, numeric=True))
                print(table_row(name, *(f"{v:.2f}" for v in result.values())), flush=True)
    if args.profile_only:
        return

    import torch

    from jaxgen.models.embedded import embedded_path
    from jaxgen.models.hf_export import hf_from_jaxgen

    torch.set_num_threads(args.threads)
    hf = hf_from_jaxgen(model, stacked)
    print(isa_line())
    try:
        import llama_cpp  # noqa: F401
        gguf_q4 = embedded_path(DEFAULT_MODEL)
    except ImportError:
        gguf_q4 = None
        print("llama_cpp is not installed: no llama.cpp rows (pip install llama-cpp-python)")
    gguf_f32 = None if gguf_q4 is None else write_f32_gguf(
        gguf_q4, os.path.join(tempfile.mkdtemp(), "smollm2-f32.gguf"))
    print(table_header("batch", "system", "ms/step", "tok/s", "x transformers", "x bw floor",
                       "compile s", numeric=True))
    for batch in args.batches:
        prompts = prompts_of(tokenizer, batch, args.prompt_tokens)
        rows = []
        hf_s = transformers_ms_per_token(hf, prompts, args.new_tokens, args.repeats)
        rows.append(("transformers fp32", hf_s, None))
        defaults = {name: p for name, (p, layout, *kernels) in layouts.items()
                    if layout == "auto" and kernels in ([], ["auto"])}
        peers = {} if gguf_q4 is None or batch != 1 else {
            name: llama_cpp_generation(path, prompts[0], args.new_tokens, args.threads)
            for name, path in (("llama.cpp F32", gguf_f32), ("llama.cpp Q4_1", gguf_q4))}
        timed = jaxgen_interleaved_ms_per_token(model, defaults, prompts, args.new_tokens,
                                                args.repeats, peers)
        del peers  # the llama.cpp models' memory
        for name, (p, layout, *kernels) in layouts.items():
            per_token, compile_s = timed[name] if name in timed else jaxgen_ms_per_token(
                model, p, prompts, args.new_tokens, args.repeats, layout, *kernels)
            rows.append((name, per_token, compile_s))
        rows.extend((name, *timed[name]) for name in ("llama.cpp F32", "llama.cpp Q4_1")
                    if name in timed)
        floor = fp32_bytes / (bandwidth * 1e9)
        compute_floor = 2 * matmul_params(model) * batch / flops
        for name, per_token, compile_s in rows:
            print(table_row(batch, name, f"{per_token * 1e3:.1f}", f"{batch / per_token:.1f}",
                            f"{hf_s / per_token:.2f}", f"{per_token / floor:.2f}",
                            "" if compile_s is None else f"{compile_s:.1f}"))
        print(table_row(batch, "bandwidth floor (fp32)", f"{floor * 1e3:.1f}",
                        f"{batch / floor:.1f}", "", "1.00", ""))
        print(table_row(batch, "compute floor (fp32)", f"{compute_floor * 1e3:.1f}",
                        f"{batch / compute_floor:.1f}", "", "", ""))
        for name, bytes_read in (("int8", step_bytes(model, int8)), ("GGUF blocks", blocks_bytes)):
            own = bytes_read / (bandwidth * 1e9)
            print(table_row(batch, f"bandwidth floor ({name})", f"{own * 1e3:.1f}",
                            f"{batch / own:.1f}", "", f"{own / floor:.2f}", ""))
        speeds = {name: per_token for name, per_token, _ in rows}
        for quantized, peer in (("jaxgen int8 (split per call)", "jaxgen load() as it is (split per call)"),
                                ("jaxgen GGUF Q4_1 blocks (split per call)", "llama.cpp Q4_1"),
                                ("jaxgen GGUF Q4_1 blocks (split per call)", "jaxgen load() as it is (split per call)")):
            if quantized in speeds and peer in speeds:
                print(f"batch {batch}: {quantized} at {speeds[peer] / speeds[quantized]:.2f}x "
                      f"the tokens/s of {peer}", flush=True)


if __name__ == "__main__":
    main()
