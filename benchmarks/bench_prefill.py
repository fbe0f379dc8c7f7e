"""Prefill speed: a long prompt's first forward, jaxgen against transformers (same fp32 weights)
and llama.cpp (when llama-cpp-python is installed: the shipped Q4_1 GGUF and an F32 GGUF
written from it), SmolLM2-135M-Instruct, batch 1. One run, medians of repeats, ratios within
the run.

    python benchmarks/bench_prefill.py [--prompt-tokens 512 2048 8000] [--repeats 5]

A prefill is timed as a generate call with max_new_tokens=1 (the prompt's forward plus one
token choice) in jaxgen and transformers, and as `Llama.eval(prompt)` in llama.cpp; compiles
and warm-ups are left out.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
from report_table import table_header, table_row

import jaxgen
from jaxgen.models import DEFAULT_MODEL, load
from jaxgen.runtime import compiled


def long_prompt(tokenizer, length: int) -> list[int]:
    """`length` ids of running English text."""
    text = ("The history of the city begins with a small settlement on the river, where "
            "traders met farmers and fishermen every season to exchange goods and stories. "
            "Over the centuries the market grew into a town with a bridge, a harbour and a "
            "library that kept the records of every voyage. ")
    ids = tokenizer.encode(text)
    return (ids * (length // len(ids) + 1))[:length]


def _median_seconds(run, repeats: int, settle=lambda: None) -> float:
    run()  # compile / warm-up
    settle()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def jaxgen_prefill_seconds(model, params, prompt, repeats) -> float:
    cfg = jaxgen.GenerationConfig(max_new_tokens=1, pad_token_id=0)

    def run():
        jaxgen.generate(params, jaxgen.init_state(model, [prompt], cfg),
                        cfg).sequences.block_until_ready()

    run()  # compile; the second call (the warm-up) places the kept layout on huge pages
    return _median_seconds(run, repeats, settle=compiled.wait_for_placement)


def transformers_prefill_seconds(hf, prompt, repeats) -> float:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        return _median_seconds(lambda: hf.generate(
            ids, max_new_tokens=1, do_sample=False, pad_token_id=0,
            attention_mask=torch.ones_like(ids)), repeats)


def llama_cpp_prefill_seconds(path, prompt, repeats, threads) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=len(prompt) + 8, n_threads=threads,
                n_batch=len(prompt), n_ubatch=min(len(prompt), 512), verbose=False)

    def run():
        llm.reset()
        llm.eval(prompt)

    return _median_seconds(run, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    import torch
    from bench_speed import write_f32_gguf

    from jaxgen.models.embedded import embedded_path
    from jaxgen.models.hf_export import hf_from_jaxgen

    torch.set_num_threads(args.threads)
    model, params, tokenizer = load(DEFAULT_MODEL)
    hf = hf_from_jaxgen(model, params)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama_cpp is not installed: no llama.cpp rows (pip install llama-cpp-python)")
        peers = {}
    else:
        q4 = embedded_path(DEFAULT_MODEL)
        f32 = write_f32_gguf(q4, os.path.join(tempfile.mkdtemp(), "smollm2-f32.gguf"))
        peers = {"llama.cpp F32": f32, "llama.cpp Q4_1": q4}
    seconds = {}  # (system, prompt tokens) -> median seconds
    for length in args.prompt_tokens:
        prompt = long_prompt(tokenizer, length)
        seconds["transformers fp32", length] = transformers_prefill_seconds(
            hf, prompt, args.repeats)
        seconds["jaxgen fp32, load() as it is", length] = jaxgen_prefill_seconds(
            model, params, prompt, args.repeats)
        for name, path in peers.items():
            seconds[name, length] = llama_cpp_prefill_seconds(path, prompt, args.repeats,
                                                              args.threads)
        print(f"{length} tokens: " + ", ".join(f"{name} {s:.3f} s" for (name, n), s
                                               in seconds.items() if n == length), flush=True)
    print(f"\nSmolLM2-135M-Instruct prefill, batch 1, {args.threads} threads; seconds "
          f"(x transformers' speed)\n")
    systems = list(dict.fromkeys(name for name, _ in seconds))
    print(table_header("system", *(f"{n} tokens" for n in args.prompt_tokens), numeric=True))
    for name in systems:
        print(table_row(name, *(f"{seconds[name, n]:.3f} "
                                f"({seconds['transformers fp32', n] / seconds[name, n]:.2f}x)"
                                for n in args.prompt_tokens)))


if __name__ == "__main__":
    main()
