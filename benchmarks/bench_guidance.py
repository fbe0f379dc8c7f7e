"""Classifier-free guidance: the per-step cost with guidance vs without, jaxgen's two layouts
and transformers' UnbatchedClassifierFreeGuidanceLogitsProcessor side by side, one run.

SmolLM2-135M-Instruct in fp32 (the embedded GGUF, dequantized; both libraries get the same
weights), greedy, 32-token prompts, a 12-token negative prompt per row, EOS disabled:

    python benchmarks/bench_guidance.py [--batches 1 4] [--steps 16 64] [--repeats 3]

Per-step time = (t(long) - t(short)) / (long - short new tokens), so the prefill and the
call overhead cancel; every configuration's calls are interleaved round by round and the
median over --repeats rounds is shown. Rows:

    plain      no guidance (jaxgen DecodeLoop / HF generate)
    stacked    jaxgen GuidedLoop, one cache of [2B] rows: one model call per step
    separate   jaxgen GuidedLoop, a second [B] cache: two model calls per step
    hf cfg     transformers generate(guidance_scale=, negative_prompt_ids=)

"ratio" is each row's per-step time over the same library's plain row. The guided greedy
tokens of both libraries are checked to be identical (short run).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from report_table import table_header, table_row

import jaxgen
from jaxgen.api.plan import execute, make_plan
from jaxgen.models import DEFAULT_MODEL, load
from jaxgen.models.hf_export import hf_from_jaxgen

TEXT = ("The history of the city begins with a small settlement on the river, where traders "
        "met farmers and fishermen every season to exchange goods and stories. ")
NEGATIVE = "A dull and boring list of unrelated words, repeated again."
SCALE = 1.5


def prompts_of(tokenizer, batch: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 4)
    return [ids[b:b + length] for b in range(batch)]


def jaxgen_call(model, params, prompts, negatives, new_tokens: int, layout: str):
    """One timed jaxgen call (seconds) and its sequences; layout plain / stacked / separate."""
    guided = layout != "plain"
    cfg = jaxgen.GenerationConfig(max_new_tokens=new_tokens, pad_token_id=0,
                                  guidance_scale=SCALE if guided else None)
    state = jaxgen.init_state(model, prompts, cfg)
    plan = make_plan(state, cfg, negative_prompt_ids=negatives if guided else None)
    if guided:
        plan = dataclasses.replace(plan, loop=dataclasses.replace(
            plan.loop, stacked=layout == "stacked"))
    start = time.perf_counter()
    out = execute(plan, params, state, cfg)
    out.sequences.block_until_ready()
    return time.perf_counter() - start, np.asarray(out.sequences)


def hf_call(hf, prompts, negatives, new_tokens: int, guided: bool):
    import torch

    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0, eos_token_id=None, top_k=None, top_p=None, temperature=None)
    if guided:
        kwargs.update(guidance_scale=SCALE, negative_prompt_ids=torch.tensor(negatives))
    with torch.no_grad():
        start = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    return time.perf_counter() - start, out.numpy()


def per_step(fns: dict, steps: tuple[int, int], repeats: int) -> dict:
    """ms per step of each fn(new_tokens) -> (seconds, ...): the calls of every fn are
    interleaved round by round (a shared machine's load hits all of them alike) and each
    fn's per-step time is the median over rounds of (t(long) - t(short)) / (long - short)."""
    short, long = steps
    for fn in fns.values():  # warm-up: compiles both lengths
        fn(short), fn(long)
    rounds = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t_short, t_long = fn(short)[0], fn(long)[0]
            rounds[name].append((t_long - t_short) / (long - short))
    return {name: 1e3 * float(np.median(times)) for name, times in rounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--steps", nargs=2, type=int, default=[8, 40])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    args = parser.parse_args()

    model, params, tokenizer = load(DEFAULT_MODEL)
    hf = None if args.no_hf else hf_from_jaxgen(model, params)
    negative = tokenizer.encode(NEGATIVE)
    print(table_header("batch", "library", "layout", "ms / step", "ratio to plain",
                       numeric=True))
    for batch in args.batches:
        prompts = prompts_of(tokenizer, batch, args.prompt_len)
        negatives = [negative] * batch
        fns = {("jaxgen", layout): (lambda n, lay=layout: jaxgen_call(
                   model, params, prompts, negatives, n, lay))
               for layout in ("plain", "stacked", "separate")}
        if hf is not None:
            for guided in (False, True):
                fns[("transformers", "hf cfg" if guided else "plain")] = (
                    lambda n, g=guided: hf_call(hf, prompts, negatives, n, g))
        ms = per_step(fns, args.steps, args.repeats)
        for (library, layout), value in ms.items():
            plain = ms[(library, "plain")]
            print(table_row(batch, library, layout, f"{value:.2f}", f"{value / plain:.2f}"),
                  flush=True)
        if hf is None:
            continue
        _, ours = jaxgen_call(model, params, prompts, negatives, 8, "stacked")
        _, theirs = hf_call(hf, prompts, negatives, 8, True)
        same = all(ours[b, :len(p) + 8].tolist() == theirs[b].tolist()
                   for b, p in enumerate(prompts))
        print(f"batch {batch}: guided greedy tokens identical to transformers: {same}")


if __name__ == "__main__":
    main()
