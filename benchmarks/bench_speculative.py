"""Speculative decoding on SmolLM2-135M-Instruct (fp32, CPU or whatever JAX runs on).

One run measures, against jaxgen's own non-speculative greedy on the same prompts:
  * prompt lookup (prompt_lookup_num_tokens) on input-grounded chat prompts (quote, edit,
    summarize, extract from a supplied passage of a few hundred tokens), batch 1 and batch 8.
    Batch 8 runs two batches: "mixed" (repeat, rewrite, quote and summarize, two passages)
    and "quote/edit" (repeat, rewrite and quote, three passages). "decode only" leaves out
    the prefill (timed separately with max_new_tokens=1), which both runs share;
  * the draft-model path with a small random draft (same vocabulary): acceptance, the
    draft-to-target cost ratio and the resulting speed, reported as they are;
  * transformers' assisted generation (prompt_lookup_num_tokens) and plain greedy on the same
    prompts at batch 1, same weights (dequantized GGUF), PyTorch CPU.
Greedy outputs of every jaxgen speculative run are checked against plain greedy.
Timings exclude compilation (each program runs once to warm up, then is timed).

    python benchmarks/bench_speculative.py [--new-tokens 96] [--lookup 10] [--lookup8 4]
        [--schedule8 heuristic] [--skip-hf] [--skip-draft]

Prints a markdown table.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from report_table import table_header, table_row

import jaxgen
from jaxgen import generate, init_state
from jaxgen.api.generate import default_config, outputs_to_lists

PASSAGES = [
    "The lighthouse at Kerran Point was built in 1871 from granite quarried on the island "
    "itself. For more than a century its keepers lived in two small cottages at the foot of the "
    "tower, trimming the wicks at dusk and winding the clockwork that turned the lens every "
    "twenty seconds. The light could be seen from twenty-two nautical miles on a clear night. "
    "In 1923 the oil lamp was replaced by an electric bulb fed from a diesel generator, and in "
    "1986 the station was automated and the last keeper, Margaret Doyle, moved to the mainland. "
    "Today the cottages house a small museum that displays the original lens, the keepers' log "
    "books and a collection of photographs of the ships that were wrecked on the reef before the "
    "light was built. Visitors can climb the one hundred and twelve steps to the gallery between "
    "April and October. The island has no shop, so visitors are asked to bring water and to take "
    "their rubbish home. The ferry leaves the harbour at nine in the morning and returns at four "
    "in the afternoon, weather permitting.",
    "Sourdough bread is leavened by a culture of wild yeast and lactic acid bacteria rather than "
    "by commercial yeast. To make a starter, mix equal weights of flour and water in a jar and "
    "leave it at room temperature. Every day, discard half of the mixture and feed it again with "
    "fresh flour and water. After about a week the starter should double in size within six "
    "hours of feeding and smell pleasantly sour. To bake a loaf, combine one hundred grams of "
    "active starter with three hundred and fifty grams of water and five hundred grams of bread "
    "flour. Rest the dough for thirty minutes, then add ten grams of salt. Over the next four "
    "hours, stretch and fold the dough every half hour. Shape it into a round, place it in a "
    "floured basket and leave it in the refrigerator overnight. The next morning, bake it in a "
    "covered pot at two hundred and fifty degrees for twenty minutes, then uncover it and bake "
    "for another twenty-five minutes until the crust is deep brown. Let the bread cool for at "
    "least an hour before slicing it.",
    "The village of Alder Ford holds its market every Saturday in the square beside the old "
    "stone bridge. Farmers bring eggs, cheese, honey and vegetables from the valley, and a baker "
    "from the next town sells rye bread and apple cakes from the back of a green van. The market "
    "opens at seven in the morning and closes at one in the afternoon. In winter the stalls move "
    "into the church hall, which has room for only twelve of them, so the places are given out by "
    "lottery in November. The parish council charges five pounds a stall and spends the money on "
    "the flower beds around the square. Parking is free on market days in the field behind the "
    "school, and a bus runs from the railway station every half hour. Dogs are welcome if they "
    "are kept on a lead. The market has run without a break since 1952, except for three weeks "
    "in the flood of 1968, when the bridge was closed and the square was under water.",
]
TASKS = [
    "Repeat the following passage word for word, without any changes.\n\n{p}",
    "Rewrite the following passage, changing only the past tense to the present tense where "
    "possible. Keep every other word the same.\n\n{p}",
    "Quote the first four sentences of the following passage exactly.\n\n{p}",
    "Summarize the following passage in a few sentences, reusing its wording.\n\n{p}",
]


def chat_prompts(tokenizer, tasks=TASKS, passages=PASSAGES[:2]) -> list[list[int]]:
    """One chat prompt per (task, passage), tasks outermost."""
    rows = []
    for task in tasks:
        for passage in passages:
            messages = [{"role": "user", "content": task.format(p=passage)}]
            rows.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           tokenize=True)))
    return rows


def timed(fn, repeats: int = 1):
    fn()  # compile + warm up
    best = float("inf")
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def run_jaxgen(model, params, prompts, cfg, **kw):
    def once():
        out = generate(params, init_state(model, prompts, cfg), cfg, **kw)
        jax.block_until_ready(out.sequences)
        return out
    out, seconds = timed(once)
    seqs = outputs_to_lists(out)
    new = sum(len(s) - len(p) for s, p in zip(seqs, prompts))
    print(f"  batch {len(prompts)} {'assisted' if out.speculative is not None else 'greedy'}: "
          f"{new} tokens in {seconds:.2f}s", flush=True)
    return seqs, out, seconds, new


def forward_cost(model, params, batch: int, width: int, position: int = 400) -> float:
    """Seconds per forward of `width` tokens per row against a cache of the benchmark size."""
    cache = model.init_cache(batch, 640)
    fn = jax.jit(lambda p, t, pos, c: model(p, t, pos, c).logits)
    tokens = jnp.zeros((batch, width), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(position, position + width, dtype=jnp.int32), tokens.shape)
    fn(params, tokens, pos, cache).block_until_ready()
    start = time.perf_counter()
    for _ in range(5):
        fn(params, tokens, pos, cache).block_until_ready()
    return (time.perf_counter() - start) / 5


def hf_model_from(model, params):
    import torch
    import transformers

    from jaxgen.models.llama import Llama  # noqa: F401  (jaxgen model -> HF weights)

    c = model.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_id), pad_token_id=c.pad_token_id)
    hf = transformers.LlamaForCausalLM(config).eval()
    state = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    names = {"attn_norm": ("input_layernorm.weight", False),
             "mlp_norm": ("post_attention_layernorm.weight", False),
             "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
             "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
             "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
             "w_down": ("mlp.down_proj.weight", True)}
    for key, stacked in params["layers"].items():
        suffix, transpose = names[key]
        for i in range(c.num_layers):
            arr = np.asarray(stacked[i], np.float32)
            state[f"model.layers.{i}.{suffix}"] = np.array(arr.T if transpose else arr)
    state = {k: torch.from_numpy(np.ascontiguousarray(np.asarray(v, np.float32)))
             for k, v in state.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=False)
    return hf


def run_hf(hf, prompts, new_tokens, **kw):
    import torch

    total_new, seconds, outputs = 0, 0.0, []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        args = dict(max_new_tokens=new_tokens, do_sample=False, **kw)
        with torch.no_grad():
            hf.generate(ids, **args)  # warm up
            start = time.perf_counter()
            out = hf.generate(ids, **args)
            seconds += time.perf_counter() - start
        outputs.append(out[0].tolist())
        total_new += out.shape[1] - len(prompt)
    return outputs, seconds, total_new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--lookup8", type=int, default=4,
                        help="prompt_lookup_num_tokens at batch 8")
    parser.add_argument("--schedule8", default="heuristic",
                        help="num_assistant_tokens_schedule for prompt lookup at batch 8")
    parser.add_argument("--draft-tokens", type=int, default=4, help="num_assistant_tokens")
    parser.add_argument("--batch1-prompts", type=int, default=4)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-draft", action="store_true")
    args = parser.parse_args()

    model, hf_params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    params = jaxgen.models.unstack_layers(model, hf_params)  # jaxgen's fast layout
    prompts = chat_prompts(tokenizer)
    lengths = [len(p) for p in prompts]
    print(f"devices: {jax.devices()}; prompts: {len(prompts)}, {min(lengths)}-{max(lengths)} "
          f"tokens; {args.new_tokens} new tokens per row")
    cfg = default_config(model, None, max_new_tokens=args.new_tokens)
    lookup_cfg = cfg.replace(prompt_lookup_num_tokens=args.lookup)
    rows = []  # (setting, batch, tokens/s, speed-up, decode speed-up, accepted/round,
    #             tokens/round, note)

    def speculative_row(name, batch, base_tps, new, seconds, out, same, note="", decode=""):
        spec = out.speculative
        rounds = np.asarray(spec.rounds).sum()
        acc = np.asarray(spec.accepted).sum() / max(rounds, 1)
        per_round = (np.asarray(spec.accepted).sum() + rounds) / max(rounds, 1)
        pos = np.asarray(spec.position_acceptance)
        rows.append((name, batch, new / seconds, (new / seconds) / base_tps, decode, f"{acc:.2f}",
                     f"{per_round:.2f}", f"{'=' if same else '!='} greedy; "
                     f"pos acc {[round(float(x), 2) for x in pos[:4]]}; "
                     f"{int(spec.target_forwards)} target fwd {note}"))

    # --- batch 1 (each prompt alone, summed) --------------------------------------------
    singles = prompts[:args.batch1_prompts]
    base_new = base_s = 0
    base_out = []
    for prompt in singles:
        seqs, _, seconds, new = run_jaxgen(model, params, [prompt], cfg)
        base_out += seqs
        base_new, base_s = base_new + new, base_s + seconds
    base_tps1 = base_new / base_s
    rows.append(("jaxgen greedy", 1, base_tps1, 1.0, "", "", "", ""))
    lk_new = lk_s = 0
    same = True
    agg = None
    for prompt, ref in zip(singles, base_out):
        seqs, out, seconds, new = run_jaxgen(model, params, [prompt], lookup_cfg)
        same &= seqs[0] == ref
        lk_new, lk_s = lk_new + new, lk_s + seconds
        agg = out if agg is None else _merge(agg, out)
    speculative_row(f"jaxgen prompt lookup (K={args.lookup})", 1, base_tps1, lk_new, lk_s, agg,
                    same)

    # --- batch 8: a mixed batch (every task, summaries included) and an edit/quote batch ----
    k8 = args.lookup8
    lookup8 = cfg.replace(prompt_lookup_num_tokens=k8,
                          num_assistant_tokens_schedule=args.schedule8)
    workloads = {"mixed": prompts[:8],
                 "quote/edit": chat_prompts(tokenizer, TASKS[:3], PASSAGES)[:8]}
    for label, batch_prompts in workloads.items():
        _, _, prefill_s, _ = run_jaxgen(model, params, batch_prompts,
                                        cfg.replace(max_new_tokens=1))
        ref8, _, s8, n8 = run_jaxgen(model, params, batch_prompts, cfg)
        base_tps8 = n8 / s8
        rows.append((f"jaxgen greedy, {label}", 8, base_tps8, 1.0, "1.00x", "", "",
                     f"prefill {prefill_s:.2f}s of {s8:.2f}s"))
        seqs, out, seconds, new = run_jaxgen(model, params, batch_prompts, lookup8)
        decode = (s8 - prefill_s) / max(seconds - prefill_s, 1e-9)
        per_row = np.round(np.asarray(out.speculative.tokens_per_round), 1).tolist()
        speculative_row(f"jaxgen prompt lookup (K={k8}, {args.schedule8}), {label}", 8,
                        base_tps8, new, seconds, out, seqs == ref8,
                        f"; tokens/round per row {per_row}", f"{decode:.2f}x")

    # --- draft model (random, 2 layers) ---------------------------------------------------
    if not args.skip_draft:
        from jaxgen.models.llama import Llama, LlamaConfig
        draft = Llama(LlamaConfig(vocab_size=model.vocab_size, hidden_size=64,
                                  intermediate_size=128, num_layers=2, num_heads=4,
                                  num_kv_heads=2, head_dim=16, tie_word_embeddings=True))
        dparams = draft.init_params(jax.random.key(0))
        ratio = forward_cost(draft, dparams, 1, 1) / forward_cost(model, params, 1, 1)
        dcfg = cfg.replace(num_assistant_tokens=args.draft_tokens,
                           assistant_confidence_threshold=0.0)
        d_new = d_s = 0
        same = True
        agg = None
        for prompt, ref in zip(singles[:2], base_out[:2]):
            seqs, out, seconds, new = run_jaxgen(model, params, [prompt], dcfg,
                                                 assistant_model=(draft, dparams))
            same &= seqs[0] == ref
            d_new, d_s = d_new + new, d_s + seconds
            agg = out if agg is None else _merge(agg, out)
        base_two = sum(len(s) - len(p) for s, p in zip(base_out[:2], singles[:2]))
        speculative_row(f"jaxgen random draft (K={args.draft_tokens})", 1,
                        base_tps1, d_new, d_s, agg, same,
                        f"; draft/target cost {ratio:.3f} (2 of {len(singles)} prompts, "
                        f"{base_two} greedy tokens)")

    # --- transformers ---------------------------------------------------------------------
    if not args.skip_hf:
        hf = hf_model_from(model, hf_params)
        outs, seconds, new = run_hf(hf, singles, args.new_tokens)
        hf_tps = new / seconds
        rows.append(("transformers greedy", 1, hf_tps, hf_tps / base_tps1, "", "", "",
                     f"{sum(o == r for o, r in zip(outs, base_out))}/{len(singles)} = jaxgen"))
        outs, seconds, new = run_hf(hf, singles, args.new_tokens,
                                    prompt_lookup_num_tokens=args.lookup)
        rows.append((f"transformers prompt lookup (K={args.lookup})", 1, new / seconds,
                     (new / seconds) / base_tps1, "", "", "",
                     f"{(new / seconds) / hf_tps:.2f}x transformers greedy"))

    print()
    print(table_header("setting", "batch", "tokens/s", "vs jaxgen greedy", "decode only",
                       "accepted/round", "tokens/round", "notes"))
    for name, batch, tps, speed, decode, acc, per, note in rows:
        print(table_row(name, batch, f"{tps:.1f}", f"{speed:.2f}x", decode, acc, per, note))


def _merge(a, b):
    """Sums the statistics of two single-row outputs (for the batch-1 aggregate)."""
    from jaxgen.core.speculative_stats import SpeculativeStats
    sa, sb = a.speculative, b.speculative
    merged = SpeculativeStats(
        rounds=sa.rounds + sb.rounds, drafted=sa.drafted + sb.drafted,
        accepted=sa.accepted + sb.accepted, position_tried=sa.position_tried + sb.position_tried,
        position_accepted=sa.position_accepted + sb.position_accepted,
        target_forwards=sa.target_forwards + sb.target_forwards,
        verified_positions=sa.verified_positions + sb.verified_positions,
        draft_forwards=sa.draft_forwards + sb.draft_forwards,
        num_assistant_tokens=sb.num_assistant_tokens)

    class _Out:
        speculative = merged
    return _Out()


if __name__ == "__main__":
    main()
