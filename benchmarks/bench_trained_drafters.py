"""The trained drafters of SmolLM2-135M-Instruct on held-out chat prompts (fp32, this CPU).

For each method, against jaxgen's plain decoding on the same prompts (the first --prompts of
jaxgen/train/data/prompts_heldout.jsonl, never used in training):
  * mean accepted length: tokens per verify round (accepted drafts + the target's own token),
    greedy, batch 1;
  * greedy speed-up, batch 1 (outputs compared with plain greedy: the last column);
  * sampling speed-up at T=0.7, batch 1 (tokens/s against plain sampling);
  * greedy speed-up, batch 8, in tokens/s (outputs compared likewise).
Methods: the MTP drafter (smollm2-135m-instruct-mtp-drafter), use_mtp with the MTP layer the
default model ships (params["mtp"]), the standalone draft (full vocabulary, and its pruned
draft vocabulary), early exit at the adapter's layer (with the
shipped adapter, and plain), prompt lookup. With --hf, the same target weights, the same draft
folder, the plain early exit and prompt lookup through transformers' generate() (batch 1,
greedy), and a last table: jaxgen tokens/s against transformers tokens/s, method by method.
Every timing follows a warm-up run of the same shapes (compilation excluded) and is the
median of --repeats runs (the machine is shared: medians, not means). --cost adds the cost
model: target step, verify and draft-step costs, and the speed-up they predict from the
measured acceptance (a / (verify(k+1) + drafts per round x draft step)).

    nice -n 19 python benchmarks/bench_trained_drafters.py [--prompts 4] [--new-tokens 96] \
        [--hf] [--cost] [--repeats 3]
    python benchmarks/bench_trained_drafters.py --acceptance-only --cost --no-fallback \
        --prompts 8                       # the cost model alone, no generation timings
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxgen
from jaxgen.api.generate import default_config, outputs_to_lists
from jaxgen.models import DEFAULT_MODEL, load, shipped_drafters, unstack_layers

HELDOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jaxgen", "train",
                       "data", "prompts_heldout.jsonl")


def heldout_prompts(tokenizer, count: int) -> list[list[int]]:
    with open(HELDOUT, encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][:count]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                               add_generation_prompt=True)) for t in texts]


REPEATS = [1]  # timed runs per measurement (main sets it from --repeats); the median counts


def run(params, model, prompts, cfg, key=None, assistant=None):
    """(median seconds, output) of REPEATS[0] generate calls, after a warm-up call of the
    same shapes."""
    def once():
        state = jaxgen.init_state(model, prompts, cfg, key)
        out = jaxgen.generate(params, state, cfg, assistant_model=assistant)
        jax.block_until_ready(out.sequences)
        return out
    once()
    times = []
    for _ in range(REPEATS[0]):
        start = time.perf_counter()
        out = once()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def new_tokens(out) -> int:
    return int(np.sum(np.asarray(out.lengths) - np.asarray(out.prompt_lengths)))


def acceptance(method, params, model, prompts, base, plain, assistant=None):
    """A row without timings (--acceptance-only): greedy b1 accepted length, drafts per
    round and whether the outputs equal plain greedy (one untimed run per prompt)."""
    rounds, accepted, drafted, same = 0, 0, 0, True
    for prompt, (_, plain_out) in zip(prompts, plain):
        state = jaxgen.init_state(model, [prompt], base)
        out = jaxgen.generate(params, state, base, assistant_model=assistant)
        same = same and outputs_to_lists(out) == outputs_to_lists(plain_out)
        rounds += int(np.sum(out.speculative.rounds))
        accepted += int(np.sum(out.speculative.accepted))
        drafted += int(np.sum(out.speculative.drafted))
    nan = float("nan")
    return {"method": method, "accepted_length": (rounds + accepted) / max(rounds, 1),
            "drafts_per_round": drafted / max(rounds, 1), "tokens_per_s": nan,
            "identical": "yes" if same else "NO", "identical_b8": "-", "greedy_b1": nan,
            "sample_b1": nan, "greedy_b8": nan}


def measure(method, params, model, prompts, prompts8, base, plain, batch8_plain, sample_plain,
            assistant=None):
    """One table row: accepted length, greedy b1, sampling b1, greedy b8 speed-ups."""
    seconds, rounds, accepted, drafted, tokens, same = 0.0, 0, 0, 0, 0, True
    for prompt, (plain_s, plain_out) in zip(prompts, plain):
        s, out = run(params, model, [prompt], base, assistant=assistant)
        same = same and outputs_to_lists(out) == outputs_to_lists(plain_out)
        seconds += s
        tokens += new_tokens(out)
        rounds += int(np.sum(out.speculative.rounds))
        accepted += int(np.sum(out.speculative.accepted))
        drafted += int(np.sum(out.speculative.drafted))
    greedy_up = sum(p[0] for p in plain) / seconds
    greedy_tps = tokens / seconds
    if sample_plain is None:  # --greedy-only
        nan = float("nan")
        return {"method": method, "accepted_length": (rounds + accepted) / max(rounds, 1),
                "drafts_per_round": drafted / max(rounds, 1), "tokens_per_s": greedy_tps,
                "identical": "yes" if same else "NO", "identical_b8": "-",
                "greedy_b1": greedy_up, "sample_b1": nan, "greedy_b8": nan}
    sampled = base.replace(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        s, out = run(params, model, [prompt], sampled, jax.random.key(i), assistant)
        tokens, seconds = tokens + new_tokens(out), seconds + s
    sample_up = (tokens / seconds) / sample_plain
    s8, out8 = run(params, model, prompts8, base, assistant=assistant)
    same8 = outputs_to_lists(out8) == outputs_to_lists(batch8_plain[1])
    return {"method": method, "accepted_length": (rounds + accepted) / max(rounds, 1),
            "drafts_per_round": drafted / max(rounds, 1), "tokens_per_s": greedy_tps,
            "identical": "yes" if same else "NO", "identical_b8": "yes" if same8 else "NO",
            "greedy_b1": greedy_up, "sample_b1": sample_up,
            "greedy_b8": (new_tokens(out8) / s8) / (new_tokens(batch8_plain[1]) / batch8_plain[0])}


def median_seconds(fn, *args, runs: int = 10) -> float:
    """Median seconds of fn(*args) (compiled first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


class CarriedForward:
    """model(params, tokens, positions, cache) with the cache carried from call to call
    (donated, its update written in place) as a decode loop carries it: a forward that returns
    only logits copies the whole cache every call (at 1024 tokens, SmolLM2 fp32: +14 ms a
    forward). Compiled on construction; `time_once()` times one call."""

    def __init__(self, model, params, tokens, positions, cache, **options):
        def forward(p, t, pos, c):
            out = model(p, t, pos, c, **options)
            return out.logits, out.cache

        self.params, self.tokens, self.positions = params, tokens, positions
        self.fn = jax.jit(forward, donate_argnums=3)
        _, self.cache = self.fn(params, tokens, positions, cache)  # compiled

    def time_once(self) -> float:
        start = time.perf_counter()
        _, self.cache = jax.block_until_ready(
            self.fn(self.params, self.tokens, self.positions, self.cache))
        return time.perf_counter() - start


def carried_forward_seconds(model, params, tokens, positions, cache, runs: int = 10,
                            **options) -> float:
    """Median seconds of a `CarriedForward` over `runs` calls."""
    forward = CarriedForward(model, params, tokens, positions, cache, **options)
    return float(np.median([forward.time_once() for _ in range(runs)]))


def forward_seconds(model, params, width: int, position: int = 128,
                    exit_layer: int | None = None) -> float:
    """Median seconds per batch-1 forward of `width` tokens against a cache holding
    `position` (exit_layer: only that many layers, then the head)."""
    cache = model.init_cache(1, position + 16)
    options = {} if exit_layer is None else {"exit_layer": exit_layer}
    tokens = jnp.zeros((1, width), jnp.int32)  # [1, S]
    pos = jnp.arange(position, position + width, dtype=jnp.int32)[None]  # [1, S]
    return carried_forward_seconds(model, params, tokens, pos, cache, **options)


def mtp_step_seconds(drafter, dparams, model, params, position: int = 128) -> float:
    """Median seconds of one batch-1 MTP drafter step over a cache holding `position`."""
    cache = model.init_cache(1, position + 16)
    fn = jax.jit(lambda d, p, c: drafter.step(d, model, p, jnp.array([5]),
                                              jnp.zeros((1, model.config.hidden_size)),
                                              jnp.array([position]), c)[0])
    return median_seconds(fn, dparams, params, cache)


def llama_cpp_costs(drafts) -> dict | None:
    """{k: llama.cpp's forward of k + 1 tokens / its one-token forward} on an F32 GGUF of
    the same weights (batch 1, 2 threads), or None without llama-cpp-python."""
    from bench_speed import llama_cpp_f32_forward_seconds

    seconds = llama_cpp_f32_forward_seconds([1] + [k + 1 for k in drafts])
    if seconds is None:
        return None
    print(f"llama.cpp F32 (batch 1, 2 threads): one-token forward {seconds[1] * 1e3:.1f} ms, "
          + ", ".join(f"{k + 1} tokens {seconds[k + 1] / seconds[1]:.2f}" for k in drafts),
          flush=True)
    return {k: seconds[k + 1] / seconds[1] for k in drafts}


def hf_rows(model, params, prompts, new, args, exit_layer, jaxgen_plain_tps):
    """transformers generate() on the same weights, batch 1 greedy."""
    import torch
    import transformers

    from jaxgen.models.hf_export import hf_from_jaxgen

    torch.set_num_threads(2)
    target = hf_from_jaxgen(model, params)
    draft = transformers.AutoModelForCausalLM.from_pretrained(
        args.draft_folder or shipped_drafters.shipped_folder(shipped_drafters.DRAFT_NAME),
        dtype=torch.float32).eval()
    common = dict(max_new_tokens=new, do_sample=False, eos_token_id=2, pad_token_id=2)
    methods = {"plain": {},
               "draft": dict(assistant_model=draft, num_assistant_tokens=args.k_draft,
                             num_assistant_tokens_schedule="constant",
                             assistant_confidence_threshold=args.threshold),
               f"early exit E={exit_layer} (plain)": dict(
                   assistant_early_exit=exit_layer, num_assistant_tokens=args.k_exit,
                   num_assistant_tokens_schedule="constant",
                   assistant_confidence_threshold=args.threshold),
               "prompt lookup": dict(prompt_lookup_num_tokens=args.k_lookup)}
    rows, plain_tps, reference = [], None, {}
    for name, extra in methods.items():
        tokens, seconds = 0, 0.0
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                target.generate(ids, **common, **extra)  # warm-up
                times = []
                for _ in range(REPEATS[0]):
                    start = time.perf_counter()
                    out = target.generate(ids, **common, **extra)
                    times.append(time.perf_counter() - start)
                seconds += float(np.median(times))
            got = out[0].tolist()
            if name == "plain":
                reference[i] = got
            elif got != reference[i]:
                print(f"  note: transformers {name} differs from its plain greedy on prompt {i}")
            tokens += len(got) - len(prompt)
        tps = tokens / seconds
        plain_tps = plain_tps or tps
        rows.append({"method": f"transformers {name}", "name": name, "tokens_per_s": tps,
                     "vs_hf_plain": tps / plain_tps, "vs_jaxgen_plain": tps / jaxgen_plain_tps})
    return rows


def methods_for(args, base, fast, with_adapter, no_adapter, exit_layer, mtp, draft, pruned):
    """{name: (target params, config, assistant)} of every method the table compares."""
    draft_cfg = dict(num_assistant_tokens=args.k_draft,
                     assistant_confidence_threshold=args.threshold,
                     num_assistant_tokens_schedule="constant")
    exit_cfg = dict(assistant_early_exit=exit_layer, num_assistant_tokens=args.k_exit,
                    assistant_confidence_threshold=args.threshold,
                    num_assistant_tokens_schedule="constant")
    mtp_cfg = dict(num_assistant_tokens=args.k_mtp, assistant_confidence_threshold=args.threshold,
                   num_assistant_tokens_schedule="constant")
    layer_cfg = dict(use_mtp=True, num_assistant_tokens=args.k_mtp_layer,
                     num_assistant_tokens_schedule="constant")
    methods = {
        "MTP drafter": (fast, base.replace(**mtp_cfg), mtp),
        "use_mtp: MTP layer": (fast, base.replace(**layer_cfg), None),
        f"early exit E={exit_layer} + adapter": (with_adapter, base.replace(**exit_cfg), None),
        f"early exit E={exit_layer} (plain)": (no_adapter, base.replace(**exit_cfg), None),
        "draft": (fast, base.replace(**draft_cfg), draft),
        "draft, pruned vocab": (fast, base.replace(**draft_cfg), pruned),
        "prompt lookup": (fast, base.replace(prompt_lookup_num_tokens=args.k_lookup), None),
    }
    return {k: v for k, v in methods.items() if not (k == "MTP drafter" and mtp is None)
            and not (k.startswith("use_mtp") and "mtp" not in fast)}


TARGETS = {"MTP drafter": 1.7, "use_mtp": 1.5, "draft": 1.4, "early exit": 1.15}


def cost_table(rows, costs, args, exit_layer, model) -> None:
    """The cost model per row: verify and draft-step costs in target steps, the measured
    accepted length (tokens a round), the greedy b1 speed-up they predict, and the measured
    one. With llama.cpp's forward costs (costs["llama.cpp verify"]) the same prediction
    with its verify costs, and with a verify as cheap as a step (an accelerator at batch 1).
    'needed' = the accepted length that reaches the method's target speed-up with the
    row's costs: target x (verify + drafts x draft step); above k + 1 no acceptance can."""
    peer = costs.get("llama.cpp verify")
    print("\n| method | k | verify (k+1) | draft step | accepted length | predicted greedy b1 "
          "| measured | target | needed | " + ("llama.cpp verify (k+1) | predicted | needed | "
                                              if peer else "") + "predicted at verify 1 |\n"
          + "|---" * (13 if peer else 10) + "|", flush=True)
    for row in rows:
        name = row["method"]
        k = (args.k_mtp if name.startswith("MTP") else args.k_lookup if "lookup" in name
             else args.k_exit if "exit" in name else args.k_mtp_layer
             if name.startswith("use_mtp") else args.k_draft)
        draft_cost = costs.get(name.split(":")[0], exit_layer / model.config.num_layers)
        drafts = row["drafts_per_round"]
        target = next((v for key, v in TARGETS.items()
                       if name.startswith(key) and "plain" not in name), None)

        def cells(verify):
            spent = verify + drafts * draft_cost
            needed = "-" if target is None else (
                f"{target * spent:.2f}" if target * spent <= k + 1 else
                f"{target * spent:.2f} (> {k + 1})")
            return f"{row['accepted_length'] / spent:.2f}x", needed

        predicted, needed = cells(costs["verify"][k])
        line = (f"| {name} | {k} | {costs['verify'][k]:.2f} | {draft_cost:.3f} | "
                f"{row['accepted_length']:.2f} | {predicted} | {row['greedy_b1']:.2f}x | "
                f"{f'{target}x' if target else '-'} | {needed} | ")
        if peer:
            peer_predicted, peer_needed = cells(peer[k])
            line += f"{peer[k]:.2f} | {peer_predicted} | {peer_needed} | "
        line += f"{row['accepted_length'] / (1 + drafts * draft_cost):.2f}x |"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts (batch 8 "
                        "uses the first 8, so at least 8 are read)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--k-draft", type=int, default=4)
    parser.add_argument("--k-exit", type=int, default=3)
    parser.add_argument("--k-lookup", type=int, default=4)
    parser.add_argument("--k-mtp", type=int, default=3)
    parser.add_argument("--k-mtp-layer", type=int, default=1,
                        help="drafts per round of use_mtp (the shipped MTP layer, 1 depth)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median counts)")
    parser.add_argument("--greedy-only", action="store_true",
                        help="greedy batch 1 only (no sampling or batch-8 columns)")
    parser.add_argument("--acceptance-only", action="store_true",
                        help="no timings: accepted lengths, identity and (with --cost) the "
                             "speed-ups the cost model predicts")
    parser.add_argument("--no-fallback", action="store_true",
                        help="assistant_fallback=False: every row drafts every round (what the "
                             "cost model assumes)")
    parser.add_argument("--threshold", type=float, default=0.0,
                        help="assistant_confidence_threshold (both libraries)")
    parser.add_argument("--hf", action="store_true", help="also time transformers")
    parser.add_argument("--methods", nargs="*", default=None)
    parser.add_argument("--cost", action="store_true",
                        help="print the cost model: forward seconds of target and drafts")
    parser.add_argument("--draft-folder", default=None, help="a draft other than the shipped")
    parser.add_argument("--compile-cache", default=os.path.expanduser("~/.cache/jaxgen-bench"),
                        help="JAX persistent compilation cache ('' to disable)")
    args = parser.parse_args()
    REPEATS[0] = args.repeats
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    model, params, tokenizer = load(DEFAULT_MODEL, dtype=jnp.float32)
    fast = unstack_layers(model, params)
    adapters = shipped_drafters.attach_exit_adapters({})
    exit_layers = shipped_drafters.exit_adapter_layers()
    exit_layer = exit_layers[0] if exit_layers else 10
    with_adapter = {**fast, **adapters}
    no_adapter = {k: v for k, v in fast.items() if k != "exit_adapters"}
    mtp = None
    if os.path.isdir(os.path.join(shipped_drafters.WEIGHTS, shipped_drafters.MTP_DRAFTER_NAME)):
        mtp = load(shipped_drafters.MTP_DRAFTER_NAME)[:2]
    draft, draft_params, _ = shipped_drafters.load_shipped_draft(folder=args.draft_folder)
    draft_params = unstack_layers(draft, draft_params)
    pruned, pruned_params, _ = shipped_drafters.load_shipped_draft(pruned=True,
                                                                   folder=args.draft_folder)
    pruned_params = {**unstack_layers(pruned.model, pruned_params),
                     "draft_head": pruned_params["draft_head"]}
    if args.cost:
        step = forward_seconds(model, fast, 1)
        costs = {"verify": {k: forward_seconds(model, fast, k + 1) / step
                            for k in sorted({args.k_draft, args.k_exit, args.k_lookup,
                                             args.k_mtp, args.k_mtp_layer})},
                 "draft": forward_seconds(draft, draft_params, 1) / step,
                 "draft, pruned vocab": forward_seconds(pruned, pruned_params, 1) / step,
                 "prompt lookup": 0.0}
        if mtp:
            costs["MTP drafter"] = mtp_step_seconds(*mtp, model, fast) / step
        if "mtp" in fast:  # a depth step: about one decoder block + the head
            costs["use_mtp"] = forward_seconds(model, fast, 1, exit_layer=1) / step
        peer_costs = llama_cpp_costs(sorted(costs["verify"]))
        if peer_costs:
            costs["llama.cpp verify"] = peer_costs
        print(f"cost (batch 1, medians, in target-step units; target step {step * 1e3:.1f} ms): "
              + ", ".join(f"verify {k + 1} tokens {v:.2f}" for k, v in costs["verify"].items())
              + "".join(f", {name} step {costs[name]:.3f}" for name in costs
                        if name not in ("verify", "prompt lookup", "llama.cpp verify"))
              + f", early exit E={exit_layer} draft step "
              f"~{exit_layer / model.config.num_layers:.2f} (its layers; + the head)", flush=True)
    prompts8 = heldout_prompts(tokenizer, max(args.prompts, 8))
    prompts = prompts8[:args.prompts]
    base = default_config(model, None, max_new_tokens=args.new_tokens)
    if args.no_fallback:
        base = base.replace(assistant_fallback=False)
    if args.acceptance_only:
        plain = [(0.0, jaxgen.generate(fast, jaxgen.init_state(model, [p], base), base))
                 for p in prompts]
        print("| method | mean accepted length | drafts per round | greedy output = plain |\n"
              "|---|---|---|---|", flush=True)
        rows = []
        for name, (p, cfg, assistant) in methods_for(args, base, fast, with_adapter,
                                                     no_adapter, exit_layer, mtp,
                                                     (draft, draft_params),
                                                     (pruned, pruned_params)).items():
            if args.methods and not any(m in name for m in args.methods):
                continue
            row = acceptance(name, p, model, prompts, cfg, plain, assistant)
            jax.clear_caches()  # a process holding ~20 programs ran out of LLVM code memory
            rows.append(row)
            print(f"| {name} | {row['accepted_length']:.2f} | {row['drafts_per_round']:.2f} | "
                  f"{row['identical']} |", flush=True)
        if args.cost:
            cost_table(rows, costs, args, exit_layer, model)
        return
    plain = [run(fast, model, [p], base) for p in prompts]
    plain_tokens = sum(new_tokens(o) for _, o in plain)
    plain_tps = plain_tokens / sum(s for s, _ in plain)
    sample_plain, batch8_plain = None, None
    if not args.greedy_only:
        sampled = base.replace(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
        tokens, seconds = 0, 0.0
        for i, p in enumerate(prompts):
            s, out = run(fast, model, [p], sampled, jax.random.key(i))
            tokens, seconds = tokens + new_tokens(out), seconds + s
        sample_plain = tokens / seconds
        batch8_plain = run(fast, model, prompts8[:8], base)
        print(f"plain sampling b1 {sample_plain:.1f} tok/s, greedy b8 "
              f"{new_tokens(batch8_plain[1]) / batch8_plain[0]:.1f} tok/s", flush=True)
    print(f"plain greedy b1 {plain_tps:.1f} tok/s ({len(prompts)} held-out prompts, "
          f"{args.new_tokens} new tokens, medians of {args.repeats})", flush=True)
    methods = methods_for(args, base, fast, with_adapter, no_adapter, exit_layer, mtp,
                          (draft, draft_params), (pruned, pruned_params))
    rows = []
    print("| method | mean accepted length | greedy speed-up b1 | sampling T=0.7 speed-up b1 "
          "| greedy b8 | greedy output = plain (b1 / b8) |\n|---|---|---|---|---|---|",
          flush=True)
    for name, (p, cfg, assistant) in methods.items():
        if args.methods and not any(m in name for m in args.methods):
            continue
        if name == "MTP drafter" and mtp is None:
            continue
        row = measure(name, p, model, prompts, prompts8[:8], cfg, plain, batch8_plain,
                      sample_plain, assistant)
        rows.append(row)
        print(f"| {name} | {row['accepted_length']:.2f} | {row['greedy_b1']:.2f}x | "
              f"{row['sample_b1']:.2f}x | {row['greedy_b8']:.2f}x | "
              f"{row['identical']} / {row['identical_b8']} |", flush=True)
    if args.cost:
        cost_table(rows, costs, args, exit_layer, model)
    if args.hf:
        print("\n| transformers (same weights), greedy b1 | tok/s | vs transformers plain | "
              "vs jaxgen plain |\n|---|---|---|---|", flush=True)
        hf = hf_rows(model, params, prompts, args.new_tokens, args, exit_layer, plain_tps)
        for row in hf:
            print(f"| {row['method']} | {row['tokens_per_s']:.1f} | {row['vs_hf_plain']:.2f}x | "
                  f"{row['vs_jaxgen_plain']:.2f}x |", flush=True)
        ours = {"plain": plain_tps, **{r["method"]: r["tokens_per_s"] for r in rows}}
        same = {"plain": "plain", "draft": "draft",
                f"early exit E={exit_layer} (plain)": f"early exit E={exit_layer} (plain)",
                "prompt lookup": "prompt lookup"}
        print("\n| same method, greedy b1 | jaxgen tok/s | transformers tok/s | jaxgen / "
              "transformers |\n|---|---|---|---|", flush=True)
        for row in hf:
            mine = ours.get(same.get(row["name"], ""))
            if mine:
                print(f"| {row['name']} | {mine:.1f} | {row['tokens_per_s']:.1f} | "
                      f"{mine / row['tokens_per_s']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
