"""The exit adapter for SmolLM2's self-speculative early exit (`assistant_early_exit=E`):
a small residual module (jaxgen.models.exit_adapter) between layer E's hidden state and the
target's own final norm + head, distilled so that the exit's distribution matches the full
model's at the same position (forward KL). The target is frozen; only the adapter trains.

    # which E: plain-exit agreement with the target on held-out answers, and a cost model
    python -m jaxgen.train.fit_exit_adapter --measure --heldout data/distill_heldout
    # train and ship the adapter of layer E
    python -m jaxgen.train.fit_exit_adapter --exit 10 --data data/distill_train \
        --heldout data/distill_heldout --ckpt ckpt/exit10 \
        --out jaxgen/models/weights/smollm2-135m-instruct-exit-adapters
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.models.exit_adapter import apply_exit_adapter, init_exit_adapter

from .batches import DistillSet, position_batch
from .fit_standalone_draft import head_logits, target_frozen
from .losses import distill_loss
from .optim import OptimConfig
from .trainer import TrainConfig, train


def make_loss(target, ce_weight: float = 0.0):
    """loss_fn(adapter, frozen target head, position batch) -> (loss, metrics); with
    frozen["vocab"] the KL is over the draft vocabulary (as in standalone_draft)."""
    eps = target.config.rms_norm_eps

    def loss_fn(adapter, frozen, batch):
        vocab = frozen.get("vocab")
        exit_hidden = batch["exit_hidden"].astype(jnp.float32)[None]  # [1, N, D]
        student = head_logits(target, frozen, apply_exit_adapter(adapter, exit_hidden, eps),
                              vocab)  # [1, N, V]
        teacher = head_logits(target, frozen, batch["hidden"].astype(jnp.float32)[None],
                              vocab)  # [1, N, V]
        return distill_loss(student, teacher, jnp.ones(student.shape[:-1]), ce_weight)

    return loss_fn


def evaluate(loss_fn, adapter, frozen, data: DistillSet, exit_layer: int,
             batch: int = 1024, limit: int | None = None) -> dict:
    """Mean metrics over the answer positions of `data` (the first `limit`; adapter None:
    the plain exit)."""
    positions = data.answer_positions()[:limit]
    if adapter is None:
        dim = data.final.shape[-1]
        adapter = {"norm": jnp.ones((dim,)), "w_in": jnp.zeros((dim, 1)),
                   "w_out": jnp.zeros((1, dim))}
    step = jax.jit(loss_fn)
    totals, weight = {}, 0
    for start in range(0, len(positions), batch):
        index = positions[start:start + batch]
        chunk = {"exit_hidden": np.asarray(data.layers[exit_layer][index]),
                 "hidden": np.asarray(data.final[index])}
        _, metrics = step(adapter, frozen, chunk)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) * len(index)
        weight += len(index)
    return {k: round(v / weight, 4) for k, v in totals.items()}


def expected_speedup(agreement: float, exit_layer: int, layers: int, drafts: int,
                     head_share: float = 0.2) -> float:
    """A greedy round's tokens over its cost, in full-step units: K drafts each costing
    E/L of the layers plus the head, then one verify pass over layers [E, L) (at batch 1 on a
    CPU, a few positions cost about one step); accepted length from per-token agreement a:
    (1 - a^(K+1)) / (1 - a)."""
    a = min(agreement, 0.999)
    tokens = (1 - a ** (drafts + 1)) / (1 - a)
    draft = drafts * ((1 - head_share) * exit_layer / layers + head_share)
    verify = (1 - head_share) * (layers - exit_layer) / layers + head_share
    return tokens / (draft + verify)


def save_adapter(adapter: dict, exit_layer: int, folder: str, info: dict) -> str:
    """folder/exit_adapter_{E}.safetensors (fp16, keys norm / w_in / w_out) + its json."""
    from jaxgen.models.safetensors_io import write_safetensors

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"exit_adapter_{exit_layer}.safetensors")
    write_safetensors(path, {k: np.asarray(v, np.float16) for k, v in adapter.items()},
                      metadata={"exit_layer": str(exit_layer)})
    with open(os.path.join(folder, f"exit_adapter_{exit_layer}.json"), "w",
              encoding="utf-8") as f:
        json.dump(info, f, indent=2)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="plain exits: pick E")
    parser.add_argument("--exit", type=int, default=None)
    parser.add_argument("--data", default=None)
    parser.add_argument("--heldout", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--vocab", default=None, help="train on a draft vocabulary (json)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--drafts", type=int, default=3, help="K for the cost model")
    parser.add_argument("--limit", type=int, default=None, help="positions to evaluate")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from jaxgen.models import load

    started = time.time()
    target, target_params, _ = load(args.target)
    vocab = None
    if args.vocab:
        with open(args.vocab, encoding="utf-8") as f:
            vocab = json.load(f)["vocab"]
    frozen = target_frozen(target, target_params, vocab)
    loss_fn = make_loss(target)
    layers = target.config.num_layers
    if args.measure:
        heldout = DistillSet.load(args.heldout)
        for exit_layer in sorted(heldout.layers):
            metrics = evaluate(loss_fn, None, frozen, heldout, exit_layer, limit=args.limit)
            gain = expected_speedup(metrics["top1"], exit_layer, layers, args.drafts)
            print(json.dumps({"exit": exit_layer, **metrics,
                              "model_speedup_k%d" % args.drafts: round(gain, 3)}), flush=True)
        return
    data = DistillSet.load(args.data)
    positions = data.answer_positions()
    adapter = init_exit_adapter(jax.random.key(args.seed), target.config.hidden_size,
                                args.width)
    batch_at = lambda step: position_batch(data, positions, step, args.batch,  # noqa: E731
                                           args.exit, seed=args.seed)
    cfg = TrainConfig(OptimConfig(learning_rate=args.lr, warmup_steps=20,
                                  total_steps=args.steps, weight_decay=0.0),
                      checkpoint_every=args.checkpoint_every)
    adapter, history = train(loss_fn, adapter, frozen, batch_at, cfg,
                             checkpoint_dir=args.ckpt, stop_at=args.stop_at,
                             log=lambda s: print(s, flush=True))
    info = {"command": "python -m jaxgen.train.fit_exit_adapter " + " ".join(argv or []),
            "args": vars(args), "last": history[-1] if history else None,
            "seconds_this_run": round(time.time() - started)}
    if args.heldout:
        heldout = DistillSet.load(args.heldout)
        info["heldout_plain"] = evaluate(loss_fn, None, frozen, heldout, args.exit,
                                         limit=args.limit)
        info["heldout_adapter"] = evaluate(loss_fn, adapter, frozen, heldout, args.exit,
                                           limit=args.limit)
        print("heldout", json.dumps(info["heldout_plain"]), json.dumps(info["heldout_adapter"]),
              flush=True)
    if args.out:
        print("wrote", save_adapter(adapter, args.exit, args.out, info), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
