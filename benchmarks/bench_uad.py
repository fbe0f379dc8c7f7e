"""Universal assisted decoding on SmolLM2-135M-Instruct (fp32) with a draft of another tokenizer.

The trained other-tokenizer draft comes from the trained-drafters issue; until then the draft
is built here, untrained:
  * its tokenizer (--tokenizer): "cut" (default) is SmolLM2's BPE cut to its first --vocab
    tokens (fewer merges: rarer words split differently) with every non-special id reversed;
    "trained" is a byte-level BPE of up to --vocab tokens trained with `tokenizers` on
    SmolLM2's answers to a few corpus prompts (not the benchmark's) and the repository's docs
    (its splits differ from SmolLM2's almost everywhere, so SmolLM2's weights draft badly
    through it: only a trained draft makes it useful);
  * its model: SmolLM2's first --layers layers, final norm and tied head, with the embedding
    row of every token string both vocabularies share (zero rows elsewhere).
Both are byte-level, so most of the draft's tokens have a target twin; the draft's ids are
its own (a different vocabulary, different merges).

For batch 1 and --batch, against jaxgen's plain greedy on the same chat prompts (outputs are
checked to be identical) it reports tokens/s, the ratio, tokens per verify round, acceptance
(accepted / drafted target drafts) and the host work per round (tokenizers, alignment, round
arrays: `ChunkTimings.host_s` / rounds) next to the whole round. With --hf, transformers' UAD
(`generate(assistant_model=, tokenizer=, assistant_tokenizer=)`, PyTorch CPU, batch 1 only)
runs on the same pair. Timings exclude compilation (each program runs once first).

With --host-only it measures only the host work of a greedy round (jaxgen.drivers.uad.UadRows:
assistant inputs, round arrays, the drafts' re-encoding and alignment) on a fixed English
continuation, without the device: the per-round overhead UAD adds, by batch size.

With --draft-model NAME it runs a trained draft with its own tokenizer instead of the built
one (smollm2-135m-instruct-uad-draft: jaxgen.train.fit_uad_draft); --hf-batch also times
transformers' UAD on the --batch prompts, one row after the other (it has no batched UAD), and
each transformers row reports jaxgen UAD's speed-up over it.

    python benchmarks/bench_uad.py [--new-tokens 64] [--batch 8] [--layers 10] [--draft 4]
        [--vocab 8000] [--tokenizer cut|trained] [--repeats 2] [--hf] [--host-only]
    python benchmarks/bench_uad.py --draft-model smollm2-135m-instruct-uad-draft --hf --hf-batch
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from report_table import table_header, table_row
from tokenizers import decoders, pre_tokenizers, trainers
from tokenizers import models as tok_models

import jaxgen
from jaxgen.api.generate import default_config, outputs_to_lists
from jaxgen.drivers.chunked import ChunkTimings
from jaxgen.models import DEFAULT_MODEL, Llama, load, unstack_layers
from jaxgen.models.tokenizer import Tokenizer
from jaxgen.speculative.uad.bridge import TokenBridge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS_PROMPTS = ["Describe a walk in the forest.", "How do airplanes fly?",
                  "Give three tips for learning a language.", "What is photosynthesis?",
                  "Write a short story about a robot.", "Explain what a computer does.",
                  "Why do we sleep?", "Describe your favourite meal."]
PROMPTS = ["Write a short poem about the sea.", "Explain in two sentences why the sky is blue.",
           "List five fruits and their colors.", "What is the capital of France?",
           "How do I boil an egg?", "Name three planets and describe them.",
           "What is a good name for a cat?", "Tell me a fun fact about octopuses."]


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def build_draft_tokenizer(model, params, tokenizer, vocab: int, new_tokens: int) -> Tokenizer:
    """A byte-level BPE trained on SmolLM2's answers to CORPUS_PROMPTS and the docs."""
    answers = jaxgen.generate_text(model, params, tokenizer, CORPUS_PROMPTS, chat=True,
                                   max_new_tokens=new_tokens)
    texts = list(answers) + CORPUS_PROMPTS
    for name in ("README.md", os.path.join("docs", "DESIGN.md")):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            texts.append(f.read())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = tokenizers.Tokenizer(tok_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(backend, special_tokens={"eos_token": "<|im_end|>",
                                              "bos_token": "<|im_start|>"})


def cut_tokenizer(tokenizer, vocab: int) -> Tokenizer:
    """SmolLM2's BPE keeping its first `vocab` tokens (and the merges that make them), every
    id above the special tokens reversed: another vocabulary with fewer merges."""
    import json

    spec = json.loads(tokenizer.backend.to_str())
    specials = {t["content"]: t["id"] for t in spec["added_tokens"]}
    low = max(specials.values()) + 1
    kept = {s: i for s, i in spec["model"]["vocab"].items() if i < vocab}
    spec["model"]["vocab"] = {s: (i if i < low else low + vocab - 1 - i) for s, i in kept.items()}
    spec["model"]["merges"] = [m for m in spec["model"]["merges"]
                               if "".join(m if isinstance(m, list) else m.split(" ")) in kept]
    return Tokenizer(tokenizers.Tokenizer.from_str(json.dumps(spec)),
                     special_tokens={"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})


def build_draft_model(model, params, tokenizer, draft_tokenizer, layers: int):
    """SmolLM2's first `layers` layers over the draft's vocabulary (shared rows copied)."""
    vocab = len(draft_tokenizer)
    bridge = TokenBridge(tokenizer, draft_tokenizer, model.vocab_size, vocab)
    shared = bridge.to_target >= 0  # [Va]
    embed = np.asarray(params["embed"])[np.where(shared, bridge.to_target, 0)]  # [Va, D]
    embed = np.where(shared[:, None], embed, 0.0).astype(np.float32)
    draft = Llama(dataclasses.replace(model.config, vocab_size=vocab, num_layers=layers))
    stacked = {name: array[:layers] for name, array in params["layers"].items()}
    draft_params = {"embed": jnp.asarray(embed), "layers": stacked,
                    "final_norm": params["final_norm"]}
    return draft, draft_params, int(shared.sum())


def timed(run, repeats: int):
    """(best seconds, last output); the first call compiles."""
    out = run()
    jax.block_until_ready(out.sequences)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        jax.block_until_ready(out.sequences)
        best = min(best, time.perf_counter() - start)
    return best, out


def hf_uad_seconds(model, params, draft, draft_params, raw_target, raw_draft, prompts, args):
    """transformers' UAD, PyTorch CPU, one row at a time (it has no batched UAD): (seconds
    for all `prompts`, ids of each)."""
    import torch
    import transformers

    from jaxgen.models.hf_export import hf_from_jaxgen

    target_hf, draft_hf = hf_from_jaxgen(model, params), hf_from_jaxgen(draft, draft_params)
    for each in (target_hf, draft_hf):  # no EOS, as jaxgen's runs here: every row runs long
        each.generation_config.eos_token_id = None
    fast = lambda raw, eos: transformers.PreTrainedTokenizerFast(  # noqa: E731
        tokenizer_object=raw, eos_token=eos)
    kw = dict(assistant_model=draft_hf, tokenizer=fast(raw_target, "<|im_end|>"),
              assistant_tokenizer=fast(raw_draft, "<|im_end|>"), do_sample=False,
              max_new_tokens=args.new_tokens, num_assistant_tokens=args.draft, pad_token_id=0,
              assistant_confidence_threshold=0.0)  # as jaxgen's UAD runs here
    rows, seconds = [], 0.0
    with torch.no_grad():
        target_hf.generate(torch.tensor([prompts[0]]), **{**kw, "max_new_tokens": 4})
        for prompt in prompts:
            start = time.perf_counter()
            out = target_hf.generate(torch.tensor([prompt]), **kw)
            seconds += time.perf_counter() - start
            rows.append(out[0].tolist())
    return seconds, rows


def host_only(tokenizer, draft_tok, args) -> None:
    """Median host ms per greedy round at batch 1, 4 and --batch (no device work)."""
    from types import SimpleNamespace

    from jaxgen.drivers.uad import UadRows
    from jaxgen.speculative.uad.drafter import UadDrafter

    bridge = TokenBridge(tokenizer, draft_tok, len(tokenizer), len(draft_tok))
    text = tokenizer.encode(" The waves of the ocean crash against the shore, a constant "
                            "rhythm of life and motion, and the gulls cry overhead." * 4)
    print(table_header("batch", "host ms/round", "per row"))
    for batch in sorted({1, 4, args.batch}):
        rows = UadRows(UadDrafter(model=None, num_tokens=args.draft, sample=False), bridge,
                       SimpleNamespace(target_lookbehind=10, assistant_lookbehind=10),
                       batch, 4096)
        prompts = [chat(tokenizer, PROMPTS[b % len(PROMPTS)]) for b in range(batch)]
        seconds = []
        for step in range(1, 41):  # 2 target tokens per round; the next 4 as the drafts
            target = [p + text[:step * 2] for p in prompts]
            later = draft_tok.encode(tokenizer.decode(text[step * 2:step * 2 + 6]))[:args.draft]
            drafts = np.zeros((batch, args.draft), np.int64)
            drafts[:, :len(later)] = later
            start = time.perf_counter()
            inputs = rows.assistant_inputs(target, np.ones(batch, bool))
            rows.host_round(inputs)
            rows.record_drafts(inputs, np.ones(batch, bool), drafts,
                               np.full(batch, len(later)), target)
            seconds.append(time.perf_counter() - start)
        ms = 1e3 * float(np.median(seconds[5:]))
        print(table_row(batch, f"{ms:.2f}", f"{ms / batch:.2f}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=10, help="draft layers (of 30)")
    parser.add_argument("--draft", type=int, default=4, help="num_assistant_tokens (K)")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--tokenizer", choices=("cut", "trained"), default="cut")
    parser.add_argument("--draft-model", default=None, metavar="NAME",
                        help="a trained draft with its own tokenizer (jaxgen.models.load), "
                             "e.g. smollm2-135m-instruct-uad-draft, instead of the built one")
    parser.add_argument("--hf-batch", action="store_true",
                        help="with --hf, also time transformers' UAD on the --batch prompts "
                             "(one row after the other)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hf", action="store_true", help="also time transformers' UAD")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host work per round (no model runs)")
    args = parser.parse_args()

    model, stacked, tokenizer = load(DEFAULT_MODEL, dtype=jnp.float32)
    if args.host_only:
        return host_only(tokenizer, cut_tokenizer(tokenizer, args.vocab), args)
    params = unstack_layers(model, stacked)
    if args.draft_model:
        draft, draft_stacked, draft_tok = load(args.draft_model, dtype=jnp.float32)
        shared = int(np.sum(TokenBridge(tokenizer, draft_tok, model.vocab_size,
                                        len(draft_tok)).to_target >= 0))
        c = draft.config
        print(f"draft: {args.draft_model}: {len(draft_tok)}-token byte-level BPE ({shared} "
              f"token strings shared with SmolLM2's {model.vocab_size}), hidden "
              f"{c.hidden_size}, {c.num_layers} layers, K={args.draft}")
    else:
        draft_tok = (cut_tokenizer(tokenizer, args.vocab) if args.tokenizer == "cut" else
                     build_draft_tokenizer(model, params, tokenizer, args.vocab, 96))
        draft, draft_stacked, shared = build_draft_model(model, stacked, tokenizer, draft_tok,
                                                         args.layers)
        print(f"draft: {len(draft_tok)}-token byte-level BPE ({args.tokenizer}; {shared} "
              f"token strings shared with SmolLM2's {model.vocab_size}), SmolLM2's first "
              f"{args.layers} of {model.config.num_layers} layers, K={args.draft}")
    draft_params = unstack_layers(draft, draft_stacked)
    cfg = default_config(model, None, max_new_tokens=args.new_tokens, eos_token_id=None)
    uad_cfg = cfg.replace(num_assistant_tokens=args.draft, assistant_confidence_threshold=0.0)
    rows = []
    for batch in (1, args.batch):
        prompts = [chat(tokenizer, PROMPTS[b % len(PROMPTS)]) for b in range(batch)]
        plain_s, plain = timed(lambda: jaxgen.generate(
            params, jaxgen.init_state(model, prompts, cfg), cfg), args.repeats)
        new = int(np.sum(np.asarray(plain.lengths) - np.asarray(plain.prompt_lengths)))
        rows.append((batch, "jaxgen greedy", new / plain_s, 1.0, "", "", "", ""))
        timings = []

        def uad():
            timings.append(ChunkTimings())
            return jaxgen.generate(params, jaxgen.init_state(model, prompts, uad_cfg), uad_cfg,
                                   assistant_model=(draft, draft_params), tokenizer=tokenizer,
                                   assistant_tokenizer=draft_tok, timings=timings[-1])
        seconds, out = timed(uad, args.repeats)
        assert outputs_to_lists(out) == outputs_to_lists(plain), "greedy mismatch"
        stats, last = out.speculative, timings[-1]
        rounds = max(last.chunks, 1)
        rows.append((batch, "jaxgen UAD", new / seconds, plain_s / seconds,
                     f"{float(np.mean(stats.tokens_per_round)):.2f}",
                     f"{float(np.sum(stats.accepted) / max(np.sum(stats.drafted), 1)):.2f}",
                     f"{1e3 * last.host_s / rounds:.2f}", f"{1e3 * seconds / rounds:.1f}"))
        if args.hf and (batch == 1 or args.hf_batch):
            hf_s, hf_ids = hf_uad_seconds(model, stacked, draft, draft_stacked, tokenizer.backend,
                                          draft_tok.backend, prompts, args)
            same = hf_ids == outputs_to_lists(plain)
            rows.append((batch, "transformers UAD" + ("" if same else " (other tokens!)"),
                         batch * args.new_tokens / hf_s, plain_s / hf_s, "", "", "", ""))
            rows.append((batch, "jaxgen UAD vs transformers UAD", "", hf_s / seconds,
                         "", "", "", ""))
    print(f"\nSmolLM2-135M-Instruct fp32, {args.new_tokens} new tokens per row, "
          f"{jax.devices()[0].platform}\n")
    print(table_header("batch", "method", "tok/s", "vs jaxgen greedy", "tokens/round",
                       "acceptance", "host ms/round", "ms/round"))
    for batch, method, tps, ratio, per_round, acceptance, host_ms, round_ms in rows:
        print(table_row(batch, method, tps if tps == "" else f"{tps:.1f}", f"{ratio:.2f}x",
                        per_round, acceptance,
                        host_ms, round_ms))


if __name__ == "__main__":
    main()
