"""The training loop every drafter shares: a jitted step (loss + grad + optax update), orbax
checkpoints every N steps, and exact resume.

A drafter kind plugs in with three things: its trainable parameter tree, a pure loss
`loss_fn(trainable, frozen, batch) -> (loss, metrics)` and its own export. `frozen` (the
target's weights) is passed in, never closed over, so one compiled step serves every batch.
Batches come from `batch_at(step)`, a function of the step alone: a resumed run sees exactly
the batches an uninterrupted run would (same params, same optimizer state, same data order).

Example (a least-squares fit):
    >>> import jax.numpy as jnp
    >>> loss_fn = lambda p, frozen, b: (jnp.mean((b["x"] * p["w"] - b["y"]) ** 2), {})
    >>> batch_at = lambda step: {"x": jnp.arange(4.0), "y": 2 * jnp.arange(4.0)}
    >>> cfg = TrainConfig(OptimConfig(learning_rate=0.1, warmup_steps=1, total_steps=60))
    >>> params, history = train(loss_fn, {"w": jnp.zeros(())}, None, batch_at, cfg, log=None)
    >>> round(float(params["w"]), 1), history[-1]["loss"] < history[0]["loss"]
    (2.0, True)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from .checkpoint import checkpoint_manager, restore_latest, save_state
from .optim import OptimConfig, make_optimizer


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Steps come from optim.total_steps; a checkpoint every `checkpoint_every` steps (and at
    the end) when a folder is given; metrics are logged every `log_every` steps."""

    optim: OptimConfig = OptimConfig()
    checkpoint_every: int = 100
    log_every: int = 10
    keep_checkpoints: int = 2


def init_state(params, optimizer: optax.GradientTransformation) -> dict:
    """The training state: {"params", "opt_state", "step"} (a PyTree, checkpointed whole)."""
    return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """A jitted `step(state, frozen, batch) -> (state, metrics)`; the state is donated."""

    def step(state, frozen, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], frozen, batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return jax.jit(step, donate_argnums=0)


def add_run_arguments(parser, *, steps: int, batch: int, length: int, lr: float, warmup: int,
                      checkpoint_every: int) -> None:
    """The command-line options every sequence recipe shares (checkpoint folder, target,
    schedule, batch shape, seed), with the recipe's own defaults."""
    parser.add_argument("--ckpt", default=None, help="orbax checkpoint folder (resume)")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--stop-at", type=int, default=None, help="stop early (resume later)")
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--length", type=int, default=length)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--checkpoint-every", type=int, default=checkpoint_every)
    parser.add_argument("--seed", type=int, default=0)


def mean_metrics(loss_fn: Callable, params, frozen, batch_at: Callable[[int], Any],
                 num_batches: int) -> dict:
    """The mean of loss_fn's metrics over batch_at(0), ..., batch_at(num_batches - 1): one
    pass over held-out data, rounded to 4 places."""
    step = jax.jit(loss_fn)
    totals = {}
    for index in range(num_batches):
        _, metrics = step(params, frozen, batch_at(index))
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return {k: round(v / num_batches, 4) for k, v in totals.items()}


def train(loss_fn: Callable, params, frozen, batch_at: Callable[[int], Any], cfg: TrainConfig,
          *, checkpoint_dir: str | None = None, stop_at: int | None = None,
          log: Callable[[str], None] | None = print) -> tuple[Any, list[dict]]:
    """Trains `params` to cfg.optim.total_steps (or `stop_at`, for an interrupted run) and
    returns (params, history of logged metrics). With `checkpoint_dir`, resumes from its
    newest checkpoint and writes one every cfg.checkpoint_every steps and at the end."""
    optimizer = make_optimizer(cfg.optim)
    state = init_state(jax.tree_util.tree_map(jnp.copy, params), optimizer)  # steps donate it
    manager = checkpoint_manager(checkpoint_dir, cfg.keep_checkpoints) if checkpoint_dir else None
    if manager is not None:
        restored = restore_latest(manager, state)
        if restored is not None:
            state = restored[1]
            if log:
                log(f"resumed from step {restored[0]} ({checkpoint_dir})")
    step_fn = make_train_step(loss_fn, optimizer)
    last = cfg.optim.total_steps if stop_at is None else min(stop_at, cfg.optim.total_steps)
    history, start = [], time.perf_counter()
    step = int(state["step"])
    while step < last:
        state, metrics = step_fn(state, frozen, batch_at(step))
        step += 1
        if step % cfg.log_every == 0 or step == last:
            row = {"step": step, **{k: float(v) for k, v in metrics.items()},
                   "seconds": round(time.perf_counter() - start, 1)}
            history.append(row)
            if log:
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in row.items()))
        if manager is not None and (step % cfg.checkpoint_every == 0 or step == last):
            save_state(manager, step, state)
    if manager is not None:
        manager.close()
    return state["params"], history
