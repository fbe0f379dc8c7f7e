"""Streaming cost and time to first token on SmolLM2-135M-Instruct (fp32, batch 1, greedy).

Measures, in one run and after warm-up (compile excluded):
  * tokens/s of the single-call path (one jit, no host work until the end),
  * tokens/s of the chunked driver feeding a TextStreamer (text decoded on the host, nothing
    printed), for a few chunk sizes,
  * time to first token of the chunked driver (prefill + one token, on the host).

    python benchmarks/bench_streaming.py [--new-tokens 128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import jax
from report_table import table_header, table_row

import jaxgen
from jaxgen.drivers.chunked import ChunkTimings
from jaxgen.drivers.streamers import TextStreamer
from jaxgen.models import DEFAULT_MODEL, load


class SilentStreamer(TextStreamer):
    """Decodes exactly as TextStreamer does, but keeps the text instead of printing it."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.text = []

    def on_finalized_text(self, text, stream_end=False):
        self.text.append(text)


def best_of(repeats, run):
    best = None
    for _ in range(repeats):
        result = run()
        if best is None or result[0] < best[0]:
            best = result
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()

    model, params, tokenizer = load(DEFAULT_MODEL)
    row = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    cfg = jaxgen.default_config(model, max_new_tokens=args.new_tokens,
                                min_new_tokens=args.new_tokens)

    def single():
        state = jaxgen.init_state(model, [row], cfg)
        start = time.perf_counter()
        out = jaxgen.generate(params, state, cfg)
        out.lengths.block_until_ready()
        return time.perf_counter() - start, None

    def streamed(chunk):
        def run():
            state = jaxgen.init_state(model, [row], cfg)
            timings = ChunkTimings()
            start = time.perf_counter()
            jaxgen.generate(params, state, cfg, streamer=SilentStreamer(tokenizer),
                            chunk_size=chunk, timings=timings)
            return time.perf_counter() - start, timings
        return run

    single()  # compile
    for chunk in args.chunks:
        streamed(chunk)()
    base, _ = best_of(args.repeats, single)
    print(f"\nSmolLM2-135M-Instruct fp32, greedy, batch 1, {len(row)}-token chat prompt, "
          f"{args.new_tokens} new tokens; jax {jax.__version__}\n")
    print(table_header("path", "tokens/s", "vs single call", "time to first token"))
    print(table_row("single call (no streaming)", f"{args.new_tokens / base:.1f}", "1.00x",
                    f"{base:.2f} s (whole answer)"))
    for chunk in args.chunks:
        seconds, timings = best_of(args.repeats, streamed(chunk))
        print(table_row(f"streamed, chunk {chunk}", f"{args.new_tokens / seconds:.1f}",
                        f"{base / seconds:.2f}x", f"{timings.first_token_s * 1e3:.0f} ms"))


if __name__ == "__main__":
    main()
