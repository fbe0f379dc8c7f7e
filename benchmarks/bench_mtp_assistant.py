"""The MTP drafter assistant on SmolLM2-135M-Instruct (fp32), untrained: what a round costs.

A random drafter (2 layers, the target's width; jaxgen.models.mtp_drafter) drafts from the
target's hidden state and KV cache; its drafts are (nearly) never accepted, so this measures
cost, not speed-up: the figures a trained drafter has to beat. Batch 1, chat prompts, greedy
(outputs are checked to be identical to plain greedy). Per prompt:

  * tokens/s of plain greedy and of the assisted run, and their ratio;
  * per round: mean drafts k, mean accepted drafts (the accepted length), tokens per round;
  * per round, in target-step units (t = one plain one-token target forward, timed here):
    the draft cost (drafter steps per round x the time of one drafter step, which runs its
    2 layers on one position plus the target's LM head), the verify cost (the time of a
    target forward over the round's mean verify width, k + 1 positions) and their total:
    with a trained drafter a round pays off when tokens/round > draft + verify cost.
  * the drafter step's weight bytes against the target step's (the memory-bound estimate).
Timings exclude compilation (each program runs once first) and take the best of --repeats
(generate calls) or --step-repeats (single forwards).

    python benchmarks/bench_mtp_assistant.py [--new-tokens 64] [--draft 3] [--layers 2]
        [--repeats 3] [--step-repeats 20]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_timing import PROMPTS, best_of, timed_generate
from report_table import table_header, table_row

from jaxgen.api.generate import default_config
from jaxgen.core.output import outputs_to_lists
from jaxgen.models import DEFAULT_MODEL, load, unstack_layers
from jaxgen.models.mtp_drafter import MtpDrafterConfig, MtpDrafterModel


def step_costs(model, params, drafter, draft_params, prompt_len: int, widths, repeats):
    """Seconds of one plain target step, one drafter step and target forwards over each of
    `widths` positions, all on a cache holding prompt_len positions (batch 1)."""
    cache = model.init_cache(1, prompt_len + max(widths) + 1)
    tokens = jnp.ones((1, prompt_len), jnp.int32)
    out = jax.jit(lambda p, c: model(p, tokens, jnp.arange(prompt_len)[None], c))(params, cache)
    cache, hidden = out.cache, out.hidden[:, -1]  # [B, D]

    def forward(width):
        positions = prompt_len + jnp.arange(width, dtype=jnp.int32)[None]  # [1, width]
        run = jax.jit(lambda p, c: model(p, jnp.ones((1, width), jnp.int32), positions, c).logits)
        return best_of(lambda: run(params, cache), repeats)

    draft = jax.jit(lambda dp, p, c, h: drafter.step(dp, model, p, jnp.ones((1,), jnp.int32), h,
                                                     jnp.full((1,), prompt_len, jnp.int32), c))
    draft_s = best_of(lambda: draft(draft_params, params, cache, hidden), repeats)
    return forward(1), draft_s, {w: forward(w) for w in widths}


def nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft", type=int, default=3, help="num_assistant_tokens (K)")
    parser.add_argument("--layers", type=int, default=2, help="drafter layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-repeats", type=int, default=20,
                        help="repeats of the single-forward timings (best of)")
    args = parser.parse_args()

    model, params, tokenizer = load(DEFAULT_MODEL, dtype=jnp.float32)
    params = unstack_layers(model, params)
    tcfg = model.config
    drafter = MtpDrafterModel(MtpDrafterConfig.for_target(
        tcfg, hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
        num_layers=args.layers))
    draft_params = drafter.init_params(jax.random.key(0))
    head = params["lm_head"]  # [D, V] the LM head every drafter step reads
    draft_bytes = nbytes(draft_params) + nbytes(head)
    target_bytes = nbytes(params) - nbytes(params["embed"])  # a step gathers one embedding row
    cfg = default_config(model, None, max_new_tokens=args.new_tokens, eos_token_id=None)
    spec_cfg = cfg.replace(num_assistant_tokens=args.draft, assistant_confidence_threshold=0.0)
    rows = []
    for text in PROMPTS:
        prompt = [tokenizer.apply_chat_template([{"role": "user", "content": text}])]
        plain_s, plain = timed_generate(params, model, prompt, cfg, args.repeats)
        spec_s, out = timed_generate(params, model, prompt, spec_cfg, args.repeats,
                                     assistant_model=(drafter, draft_params))
        assert outputs_to_lists(out) == outputs_to_lists(plain), "greedy mismatch"
        stats = out.speculative
        new = int(plain.lengths[0] - plain.prompt_lengths[0])
        rounds = max(int(stats.rounds[0]), 1)
        k = int(stats.drafted[0]) / rounds  # mean drafts per round
        steps = int(stats.draft_forwards) / rounds  # drafter steps per round
        width = int(stats.verified_positions) / rounds  # mean verify width (bucket k + 1)
        widths = sorted({int(np.floor(width)), int(np.ceil(width))})
        step_s, draft_s, verify_s = step_costs(model, params, drafter, draft_params,
                                               len(prompt[0]) + new // 2, widths,
                                               args.step_repeats)
        low, high = widths[0], widths[-1]
        frac = 0.0 if high == low else width - low
        verify = ((1 - frac) * verify_s[low] + frac * verify_s[high]) / step_s
        draft = steps * draft_s / step_s
        rows.append((text[:28], f"{new / plain_s:.1f}", f"{new / spec_s:.1f}",
                     f"{plain_s / spec_s:.2f}x", f"{k:.2f}",
                     f"{int(stats.accepted[0]) / rounds:.2f}",
                     f"{float(stats.tokens_per_round[0]):.2f}", f"{draft_s / step_s:.2f}",
                     f"{draft:.2f}", f"{verify:.2f}", f"{draft + verify:.2f}"))
    print(f"\nSmolLM2-135M-Instruct fp32 ({jax.devices()[0].platform}), batch 1, "
          f"{args.new_tokens} new tokens, K={args.draft}, random MTP drafter "
          f"({args.layers} layers, width {tcfg.hidden_size}); costs per round in target-step "
          f"units (t = one plain one-token forward, timed in this run)\n")
    print(table_header("prompt", "greedy tok/s", "assisted tok/s", "vs greedy", "drafts/round",
                       "accepted/round", "tokens/round", "drafter step (t)", "draft cost (t)",
                       "verify cost (t)", "round total (t)"))
    for row in rows:
        print(table_row(*row))
    print(f"\ndrafter step weight bytes (drafter + the target's LM head) / target step bytes: "
          f"{draft_bytes / 2**20:.1f} MiB / {target_bytes / 2**20:.1f} MiB = "
          f"{draft_bytes / target_bytes:.2f}")


if __name__ == "__main__":
    main()
