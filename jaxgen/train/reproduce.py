"""One command per shipped drafter: re-trains it from scratch (data, vocabulary, training,
export) with the settings it shipped with. Steps already done in --work are reused (the data
folder when it has meta.json; training resumes from its orbax checkpoints).

    python -m jaxgen.train.reproduce draft --work repro
    python -m jaxgen.train.reproduce exit-adapter --work repro
    python -m jaxgen.train.reproduce mtp-drafter --work repro
    python -m jaxgen.train.reproduce uad-draft --work repro
    python -m jaxgen.train.reproduce mtp-layer --work repro

Measured on this 2-core machine (shared with other jobs, load 8-18): self-distillation data
18.5 min, draft 40 min (500 steps), exit adapter 11 min (300 steps). The MTP drafter reads
its own smaller data set (the first 96 prompts, 128 new tokens, the input states of the last
layer, whose K/V it reads) and the draft's vocabulary: data 15 min, training 36 min (180 of
a 250-step schedule: it ships the step-180 checkpoint), at load 10-20 under nice 19.
The UAD draft (its own tokenizer) reads text: the MTP drafter's answers (96 prompts) and
greedy answers of 160 tokens to the other 203 training prompts (uad_corpus.py); its
tokenizer is trained on that text (uad_tokenizer.py), the draft on all but the last
UAD_HOLDOUT rows (fit_uad_draft.py).
The MTP layer (use_mtp=True on the default model, fit_mtp_layer.py) reads greedy answers of 128
tokens to all 299 training prompts with the input states of the last layer (its eh_proj fit
targets them): the answers took 33 min here (as two parallel halves at batch 16), the
teacher-forced states 8 min, training 7 min (240 steps of 4 x 192 tokens, 1.7 s a step),
at load 8-9 under nice 10 (one process at batch 32, as below: expect ~1 hour in all).
"""
from __future__ import annotations

import argparse
import os

from jaxgen.models.shipped_drafters import (
    DRAFT_NAME,
    EXIT_ADAPTERS_NAME,
    MTP_DRAFTER_NAME,
    MTP_LAYER_NAME,
    UAD_DRAFT_NAME,
    WEIGHTS,
)

from . import (
    distill_data,
    fit_exit_adapter,
    fit_mtp_drafter,
    fit_mtp_layer,
    fit_standalone_draft,
    fit_uad_draft,
    uad_corpus,
    uad_tokenizer,
    vocab,
)

DRAFT_OUT = os.path.join(WEIGHTS, DRAFT_NAME)
ADAPTER_OUT = os.path.join(WEIGHTS, EXIT_ADAPTERS_NAME)
MTP_OUT = os.path.join(WEIGHTS, MTP_DRAFTER_NAME)
UAD_OUT = os.path.join(WEIGHTS, UAD_DRAFT_NAME)
MTP_LAYER_OUT = os.path.join(WEIGHTS, MTP_LAYER_NAME)
UAD_PROMPTS, UAD_HOLDOUT = 0, 24  # every training prompt; the last 24 rows held out
# 25 steps of a 150-step schedule at a low rate: the start (the standalone draft's layers,
# rows by token string) already predicts as well on held-out rows; longer or faster runs
# overfit the 31k answer tokens (held-out CE 3.06 at the start, 3.04 at 25, 3.09 at 75 and
# 3.89 after 150 steps at 1e-3)
UAD_TRAIN_ARGS = ["--steps", "150", "--stop-at", "25", "--batch", "16", "--length", "224",
                  "--lr", "2e-4", "--warmup", "10", "--checkpoint-every", "25"]
MTP_TRAIN_ARGS = ["--steps", "250", "--stop-at", "180", "--batch", "4", "--length", "192", "--draft-steps", "3",
                  "--lr", "1e-3", "--warmup", "10", "--checkpoint-every", "10"]


def prepare(work: str) -> tuple[str, str]:
    """The distillation data and the draft vocabulary under `work` (made when missing)."""
    data = os.path.join(work, "distill_train")
    if not os.path.isfile(os.path.join(data, "meta.json")):
        distill_data.main(["--out", data, "--samples", "0", "--new-tokens", "160",
                           "--exits", "6", "8", "10", "12", "15"])
    vocab_file = os.path.join(work, "draft_vocab.json")
    if not os.path.isfile(vocab_file):
        vocab.main(["--data", data, "--size", "8192", "--out", vocab_file])
    return data, vocab_file


def prepare_mtp(work: str) -> str:
    """The MTP drafter's distillation data under `work` (made when missing)."""
    data = os.path.join(work, "distill_mtp")
    if not os.path.isfile(os.path.join(data, "meta.json")):
        distill_data.main(["--out", data, "--samples", "0", "--new-tokens", "128",
                           "--batch", "32", "--limit", "96", "--exits", "29"])
    return data


MTP_LAYER_TRAIN_ARGS = ["--steps", "240", "--batch", "4", "--length", "192", "--lr", "3e-4",
                        "--warmup", "15", "--checkpoint-every", "20"]


def prepare_mtp_layer(work: str) -> str:
    """The MTP layer's distillation data under `work` (made when missing): greedy answers to
    every training prompt and the last layer's input states."""
    data = os.path.join(work, "distill_mtp_layer")
    if not os.path.isfile(os.path.join(data, "meta.json")):
        distill_data.main(["--out", data, "--samples", "0", "--new-tokens", "128",
                           "--batch", "32", "--exits", "29"])
    return data


def prepare_uad(work: str) -> tuple[str, str]:
    """The UAD draft's text corpus and tokenizer under `work` (made when missing)."""
    corpus = os.path.join(work, "uad_corpus.jsonl")
    uad_corpus.main(["--out", corpus, "--distill", prepare_mtp(work), "--new-tokens", "160",
                     "--batch", "16", "--limit", str(UAD_PROMPTS)])  # resumes; no-op when done
    tokenizer = os.path.join(work, "uad_tokenizer.json")
    if not os.path.isfile(tokenizer):
        uad_tokenizer.main(["--corpus", corpus, "--size", "8000", "--min-frequency", "1",
                            "--out", tokenizer])
    return corpus, tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", choices=("draft", "exit-adapter", "mtp-drafter", "uad-draft",
                                                "mtp-layer"))
    parser.add_argument("--work", required=True, help="data and checkpoints (outside the repo)")
    parser.add_argument("--out", default=None, help="where to write (default: the shipped place)")
    args = parser.parse_args(argv)
    if args.drafter == "mtp-drafter":
        fit_mtp_drafter.main([
            "--data", prepare_mtp(args.work),
            "--vocab", os.path.join(WEIGHTS, DRAFT_NAME, "draft_vocab.json"),
            "--ckpt", os.path.join(args.work, "ckpt_mtp"), "--out", args.out or MTP_OUT,
            *MTP_TRAIN_ARGS])
        return
    if args.drafter == "mtp-layer":
        fit_mtp_layer.main([
            "--data", prepare_mtp_layer(args.work),
            "--vocab", os.path.join(WEIGHTS, DRAFT_NAME, "draft_vocab.json"),
            "--ckpt", os.path.join(args.work, "ckpt_mtp_layer"),
            "--out", args.out or MTP_LAYER_OUT,
            *MTP_LAYER_TRAIN_ARGS])
        return
    if args.drafter == "uad-draft":
        corpus, tokenizer = prepare_uad(args.work)
        fit_uad_draft.main(["--corpus", corpus, "--tokenizer", tokenizer,
                        "--holdout", str(UAD_HOLDOUT),
                        "--ckpt", os.path.join(args.work, "ckpt_uad"),
                        "--out", args.out or UAD_OUT, *UAD_TRAIN_ARGS])
        return
    data, vocab_file = prepare(args.work)
    if args.drafter == "draft":
        fit_standalone_draft.main([
            "--data", data, "--vocab", vocab_file, "--ckpt", os.path.join(args.work, "ckpt_draft"),
            "--out", args.out or DRAFT_OUT, "--steps", "500", "--batch", "8", "--length", "224",
            "--lr", "3e-3", "--warmup", "30", "--checkpoint-every", "25"])
    else:
        fit_exit_adapter.main([
            "--exit", "15", "--data", data, "--vocab", vocab_file,
            "--ckpt", os.path.join(args.work, "ckpt_exit15"), "--out", args.out or ADAPTER_OUT,
            "--width", "1024", "--steps", "300", "--batch", "512", "--lr", "2e-3"])


if __name__ == "__main__":
    main()
