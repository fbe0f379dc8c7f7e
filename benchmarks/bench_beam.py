"""Beam search speed: jaxgen vs transformers generate(), same weights, one run.

SmolLM2-135M-Instruct in fp32 (the embedded GGUF, dequantized; both libraries get the same
weights), 4 beams, 32-token prompt, 64 new tokens (EOS disabled so every run decodes all 64),
batch 1 and 8:

    python benchmarks/bench_beam.py [--beams 4] [--new-tokens 64] [--repeats 3]

tokens/s counts the returned sequences' new tokens (batch x new tokens / seconds), best of
--repeats calls, the two libraries interleaved; compile time is the first call minus a
steady-state call; warm-up runs are excluded from the timings.
Each run's sequences are checked to be identical between the two libraries.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from report_table import table_header, table_row

import jaxgen
from jaxgen.models import DEFAULT_MODEL, load
from jaxgen.models.hf_export import hf_from_jaxgen

TEXT = ("The history of the city begins with a small settlement on the river, where traders "
        "met farmers and fishermen every season to exchange goods and stories. ")


def prompts_of(tokenizer, batch: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 4)
    return [ids[b:b + length] for b in range(batch)]


def config(beams: int, new_tokens: int) -> jaxgen.GenerationConfig:
    return jaxgen.GenerationConfig(num_beams=beams, max_new_tokens=new_tokens, pad_token_id=0)


class JaxgenRun:
    """One jaxgen beam-search configuration: compile once, then timed calls."""

    def __init__(self, model, params, prompts, beams, new_tokens):
        self.model, self.params, self.prompts = model, params, prompts
        self.cfg = config(beams, new_tokens)
        self.new_tokens = new_tokens
        start = time.perf_counter()
        self.out = self._call()
        self.first = time.perf_counter() - start  # compile + one run

    def _call(self):
        state = jaxgen.init_state(self.model, self.prompts, self.cfg)
        out = jaxgen.generate(self.params, state, self.cfg)
        out.sequences.block_until_ready()
        return out

    def timed(self) -> float:
        state = jaxgen.init_state(self.model, self.prompts, self.cfg)
        start = time.perf_counter()
        out = jaxgen.generate(self.params, state, self.cfg)
        out.sequences.block_until_ready()
        return time.perf_counter() - start

    def sequences(self) -> list[list[int]]:
        new = np.asarray(self.out.lengths) - np.asarray(self.out.prompt_lengths)
        assert (new == self.new_tokens).all(), new
        seqs = np.asarray(self.out.sequences)
        return [seqs[b, :len(p) + self.new_tokens].tolist() for b, p in enumerate(self.prompts)]


class TransformersRun:
    def __init__(self, hf, prompts, beams, new_tokens):
        import torch

        self.hf, self.torch = hf, torch
        self.ids = torch.tensor(prompts)
        self.kwargs = dict(max_new_tokens=new_tokens, do_sample=False, num_beams=beams,
                           pad_token_id=0, eos_token_id=None,
                           attention_mask=torch.ones_like(self.ids))
        with torch.no_grad():
            hf.generate(self.ids, **{**self.kwargs, "max_new_tokens": 4})  # warm-up
        self.out = None

    def timed(self) -> float:
        with self.torch.no_grad():
            start = time.perf_counter()
            self.out = self.hf.generate(self.ids, **self.kwargs)
            return time.perf_counter() - start

    def sequences(self) -> list[list[int]]:
        return self.out.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()

    import torch

    model, params, tokenizer = load(DEFAULT_MODEL, dtype=jnp.float32)
    hf = hf_from_jaxgen(model, params)
    rows = []
    for batch in args.batches:
        prompts = prompts_of(tokenizer, batch, args.prompt_tokens)
        ours_run = JaxgenRun(model, params, prompts, args.beams, args.new_tokens)
        theirs_run = TransformersRun(hf, prompts, args.beams, args.new_tokens)
        ours = theirs = float("inf")
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            ours = min(ours, ours_run.timed())
            theirs = min(theirs, theirs_run.timed())
        first = ours_run.first
        our_seqs, their_seqs = ours_run.sequences(), theirs_run.sequences()
        same = sum(a == b for a, b in zip(our_seqs, their_seqs))
        tokens = batch * args.new_tokens
        rows.append((batch, tokens / ours, tokens / theirs, theirs / ours,
                     ours / args.new_tokens * 1e3, theirs / args.new_tokens * 1e3,
                     first - ours, f"{same}/{batch}"))
    print(f"\nSmolLM2-135M-Instruct fp32, beam search ({args.beams} beams), "
          f"{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, EOS off; "
          f"best of {args.repeats}; jax {jax.__version__} ({jax.devices()[0].platform}), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)\n")
    print(table_header("batch", "jaxgen tok/s", "transformers tok/s", "speed-up",
                       "jaxgen ms/step", "transformers ms/step", "jaxgen compile s",
                       "identical sequences"))
    for batch, ours_tps, hf_tps, speedup, ours_ms, hf_ms, compile_s, same in rows:
        print(table_row(batch, f"{ours_tps:.1f}", f"{hf_tps:.1f}", f"{speedup:.2f}x",
                        f"{ours_ms:.1f}", f"{hf_ms:.1f}", f"{compile_s:.1f}", same))


if __name__ == "__main__":
    main()
