"""Constrained decoding: the automaton's per-step cost, its build time, and transformers'
prefix_allowed_tokens_fn on the same task, side by side (SmolLM2-135M-Instruct, fp32).

    python benchmarks/bench_constraints.py [--batches 1 8] [--steps 32] [--hf-tokens 48]

1. build     outlines-core -> TokenAutomaton for a date regex, an e-mail regex and a nested
             JSON schema: seconds, live states, edges, device bytes, and what a dense
             [S, V] int16 / int32 transition table would take instead.
2. step      per decode step at batch B: the constraint alone (mask [B, V] + advance, the
             schema automaton, jitted) and a whole decode step (one-token forward, choose,
             write, stop flags: DecodeLoop.advance over `steps` steps) with and without a
             constraint that never ends (regex "[a-z ]+"), as ms and as a ratio. Target: the
             automaton <= 5% of a decode step.
3. vs HF     greedy JSON-schema generation at batch 1: transformers generate() with a
             prefix_allowed_tokens_fn walking the same automaton on the host, transformers
             unconstrained, jaxgen compiled (json_schema=) and jaxgen's host path: ms per
             generated token.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxgen
from jaxgen.api.plan import canonical_config
from jaxgen.constraints import compile as constraint_compile
from jaxgen.constraints.automaton import advance, mask_scores, start_carry
from jaxgen.constraints.compile import compile_constraint
from jaxgen.loops.decode import DecodeLoop

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from constraint_fixtures import DATE, EMAIL, PERSON, HostAutomaton  # noqa: E402


def best_ms(fn, repeats: int = 3) -> float:
    fn()  # compile / warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def build_table(tokenizer, vocab: int):
    print("## automaton build (outlines-core, one CPU core)")
    print(f"{'pattern':8} {'build s':>8} {'states':>7} {'edges':>8} {'device MB':>10} "
          f"{'dense int16 MB':>15} {'dense int32 MB':>15}")
    built = {}
    for name, kwargs in (("date", dict(regex=DATE)), ("email", dict(regex=EMAIL)),
                         ("schema", dict(json_schema=PERSON))):
        constraint_compile._CACHE.clear()
        start = time.perf_counter()
        b = compile_constraint(tokenizer, vocab, **kwargs)
        seconds = time.perf_counter() - start
        dense = b.states * vocab
        print(f"{name:8} {seconds:8.2f} {b.states:7d} {b.edges:8d} "
              f"{b.automaton.nbytes / 2**20:10.2f} {dense * 2 / 2**20:15.1f} "
              f"{dense * 4 / 2**20:15.1f}")
        built[name] = b
    return built


def step_table(model, params, built, batches, steps):
    print(f"\n## per decode step (ms), SmolLM2 fp32, {steps} steps per timing")
    print(f"{'batch':>5} {'automaton':>10} {'step':>8} {'step+constraint':>16} "
          f"{'automaton/step':>15} {'in-loop overhead':>17}")
    schema = built["schema"].automaton
    live = np.flatnonzero(np.asarray(schema.offsets[1:] > schema.offsets[:-1]))
    text = compile_constraint(built["tokenizer"], model.vocab_size, regex="[a-z ]+").automaton
    cfg = jaxgen.GenerationConfig(max_new_tokens=steps + 2)  # no EOS: rows never stop
    jit_cfg = canonical_config(cfg)
    loop = DecodeLoop()
    for batch in batches:
        rng = np.random.default_rng(batch)
        states = jnp.asarray(rng.choice(live, batch), jnp.int32)  # [B]
        logits = jnp.asarray(rng.normal(size=(batch, model.vocab_size)), jnp.float32)  # [B, V]

        @jax.jit
        def constraint_only(aut, states, logits):
            masked = mask_scores(aut, states, logits, (2,))  # [B, V]
            return advance(aut, states, jnp.argmax(masked, -1).astype(jnp.int32))

        auto_ms = best_ms(lambda: jax.block_until_ready(constraint_only(schema, states,
                                                                         logits)), 20)
        prompts = [[1, 2, 3, 4]] * batch

        @jax.jit
        def run_steps(params, state):
            state, record = loop.start(params, state, jit_cfg)
            state, _ = loop.advance(params, state, record, 1, steps + 1, jit_cfg)
            return state.tokens

        def timed(constraint):
            def go():
                state = jaxgen.init_state(model, prompts, cfg)
                if constraint is not None:
                    state = state.replace(constraint=start_carry(constraint, batch))
                jax.block_until_ready(run_steps(params, state))
            return go

        plain_run, constrained_run = timed(None), timed(text)
        plain_run(), constrained_run()  # compile both
        plain = constrained = float("inf")
        for _ in range(5):  # interleaved, best of 5: other load on the machine hits both
            plain = min(plain, best_ms(plain_run, 1) / steps)
            constrained = min(constrained, best_ms(constrained_run, 1) / steps)
        print(f"{batch:5d} {auto_ms:10.3f} {plain:8.2f} {constrained:16.2f} "
              f"{auto_ms / plain:14.1%} {(constrained - plain) / plain:16.1%}")


def hf_table(model, params, tokenizer, hf, built, tokens):
    import torch

    print(f"\n## greedy JSON schema, batch 1, up to {tokens} new tokens (ms per token)")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a fictional "
                                             "person as JSON with name, age, address and "
                                             "hobbies."}])
    eos = list(model.config.eos_token_id)
    fn = HostAutomaton(built["schema"].automaton).prefix_fn([len(prompt)], eos)
    rows = {}

    def hf_run(**extra):
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=tokens,
                              do_sample=False, eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id, top_k=None, top_p=None,
                              temperature=None, **extra)
        return out[0].tolist()

    def jax_run(**extra):
        return jaxgen.generate_ids(model, params, [prompt], max_new_tokens=tokens, **extra)[0]

    cases = {"transformers + prefix_allowed_tokens_fn": lambda: hf_run(
                 prefix_allowed_tokens_fn=fn),
             "transformers unconstrained": lambda: hf_run(),
             "jaxgen json_schema= (compiled)": lambda: jax_run(tokenizer=tokenizer,
                                                              json_schema=PERSON),
             "jaxgen prefix_allowed_tokens_fn (host)": lambda: jax_run(
                 prefix_allowed_tokens_fn=fn),
             "jaxgen unconstrained": lambda: jax_run()}
    for name, run in cases.items():
        run()
        start = time.perf_counter()
        row = run()
        seconds = time.perf_counter() - start
        new = len(row) - len(prompt)
        rows[name] = row
        print(f"{name:42} {seconds / new * 1e3:8.2f} ms/token  ({new} tokens)")
    same = rows["transformers + prefix_allowed_tokens_fn"] == \
        rows["jaxgen json_schema= (compiled)"] == rows["jaxgen prefix_allowed_tokens_fn (host)"]
    print(f"constrained outputs identical (HF, jaxgen compiled, jaxgen host): {same}")
    print("jaxgen output:", repr(tokenizer.decode(rows["jaxgen json_schema= (compiled)"]
                                                 [len(prompt):], skip_special_tokens=True)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--hf-tokens", type=int, default=48)
    args = parser.parse_args()
    from jaxgen.models import DEFAULT_MODEL, load
    from jaxgen.models.hf_export import hf_from_jaxgen

    model, params, tokenizer = load(DEFAULT_MODEL)
    built = build_table(tokenizer, model.vocab_size)
    built["tokenizer"] = tokenizer
    step_table(model, params, built, args.batches, args.steps)
    hf_table(model, params, tokenizer, hf_from_jaxgen(model, params), built, args.hf_tokens)


if __name__ == "__main__":
    main()
