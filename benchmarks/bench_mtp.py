"""MTP layers from the checkpoint (`use_mtp=True`) on SmolLM2-135M-Instruct (fp32), with random
MTP weights: what a round costs.

SmolLM2 ships no MTP layers, so D random depths (one decoder block each, jaxgen.models.mtp)
are attached; their drafts are (nearly) never accepted, so this measures cost, not speed-up:
the figures trained MTP layers have to beat. Batch 1, chat prompts, greedy (outputs are checked
to be identical to plain greedy). Per prompt:

  * tokens/s of plain greedy and of use_mtp, and their ratio;
  * per round: mean drafts k, mean accepted drafts, tokens per round;
  * per round, in target-step units (t = one plain one-token target forward, timed here):
    the draft cost (each depth runs its block over the round's verified positions plus its
    draft positions, and the shared LM head on one position: timed as one depth forward over
    k + 1 positions + the head, times D), the verify cost (a target forward over k + 1
    positions) and their total: trained layers pay off when tokens/round > the total.
Timings exclude compilation and take the best of --repeats (generate calls) or --step-repeats
(single forwards).

    python benchmarks/bench_mtp.py [--new-tokens 64] [--depths 1] [--draft K] [--repeats 3]
        [--step-repeats 20]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from bench_timing import PROMPTS, best_of, timed_generate
from report_table import table_header, table_row

from jaxgen.api.generate import default_config
from jaxgen.core.output import outputs_to_lists
from jaxgen.models import DEFAULT_MODEL, load, unstack_layers
from jaxgen.models.mtp import with_mtp


def step_costs(model, params, prompt_len: int, width: int, repeats: int):
    """Seconds of one plain target step, a target forward over `width` positions, and one
    MTP depth over `width` positions plus the shared head on one (batch 1, a cache holding
    prompt_len positions)."""
    layers = model.mtp_layers()
    cache = model.init_cache(1, prompt_len + width + 1)
    tokens = jnp.ones((1, prompt_len), jnp.int32)
    out = jax.jit(lambda p, c: model(p, tokens, jnp.arange(prompt_len)[None], c))(params, cache)
    cache, hidden = out.cache, out.hidden[:, -width:]  # [1, width, H]
    mtp_cache = layers.cache(1, prompt_len + width + 1)

    def forward(size):
        positions = prompt_len + jnp.arange(size, dtype=jnp.int32)[None]  # [1, size]
        run = jax.jit(lambda p, c: model(p, jnp.ones((1, size), jnp.int32), positions, c).logits)
        return best_of(lambda: run(params, cache), repeats)

    positions = prompt_len + jnp.arange(width, dtype=jnp.int32)[None]  # [1, width]

    def depth(p, c, h):
        g, c = layers.depth(p, 0, jnp.ones((1, width), jnp.int32), layers.normed(p, h),
                            positions, positions - 1, c)
        return layers.logits(p, g[:, -1:])

    run_depth = jax.jit(depth)
    mtp_s = best_of(lambda: run_depth(params, mtp_cache, hidden), repeats)
    return forward(1), forward(width), mtp_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--depths", type=int, default=1, help="MTP depths D")
    parser.add_argument("--draft", type=int, default=None, help="K (default: D)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step-repeats", type=int, default=20)
    args = parser.parse_args()

    model, params, tokenizer = load(DEFAULT_MODEL, dtype=jnp.float32)
    model, params = with_mtp(model, params, jax.random.key(0), depths=args.depths)
    params = unstack_layers(model, params)
    cfg = default_config(model, None, max_new_tokens=args.new_tokens, eos_token_id=None)
    fields = {} if args.draft is None else dict(num_assistant_tokens=args.draft)
    mtp_cfg = cfg.replace(use_mtp=True, **fields)
    K = args.draft or args.depths
    rows = []
    for text in PROMPTS:
        prompt = [tokenizer.apply_chat_template([{"role": "user", "content": text}])]
        plain_s, plain = timed_generate(params, model, prompt, cfg, args.repeats)
        mtp_s, out = timed_generate(params, model, prompt, mtp_cfg, args.repeats)
        assert outputs_to_lists(out) == outputs_to_lists(plain), "greedy mismatch"
        stats = out.speculative
        new = int(plain.lengths[0] - plain.prompt_lengths[0])
        rounds = max(int(stats.rounds[0]), 1)
        step_s, verify_s, depth_s = step_costs(model, params, len(prompt[0]) + new // 2, K + 1,
                                               args.step_repeats)
        draft = (args.depths * depth_s + max(K - args.depths, 0) * depth_s / (K + 1)) / step_s
        verify = verify_s / step_s
        rows.append((text[:28], f"{new / plain_s:.1f}", f"{new / mtp_s:.1f}",
                     f"{plain_s / mtp_s:.2f}x", f"{int(stats.drafted[0]) / rounds:.2f}",
                     f"{int(stats.accepted[0]) / rounds:.2f}",
                     f"{float(stats.tokens_per_round[0]):.2f}", f"{depth_s / step_s:.2f}",
                     f"{draft:.2f}", f"{verify:.2f}", f"{draft + verify:.2f}"))
    print(f"\nSmolLM2-135M-Instruct fp32 ({jax.devices()[0].platform}), batch 1, "
          f"{args.new_tokens} new tokens, D={args.depths} random MTP depths, K={K}; costs per "
          f"round in target-step units (t = one plain one-token forward, timed in this run)\n")
    print(table_header("prompt", "greedy tok/s", "use_mtp tok/s", "vs greedy", "drafts/round",
                       "accepted/round", "tokens/round", "depth step (t)", "draft cost (t)",
                       "verify cost (t)", "round total (t)"))
    for row in rows:
        print(table_row(*row))


if __name__ == "__main__":
    main()
