"""The optimizer every drafter trains with: AdamW under a warmup + cosine schedule, after
global-norm gradient clipping (optax).

Example:
    >>> import jax.numpy as jnp
    >>> opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=2, total_steps=10))
    >>> params = {"w": jnp.ones((2,))}
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.ones((2,))}
    >>> updates, state = opt.update(grads, state, params)     # step 0: warmup starts at 0
    >>> updates, state = opt.update(grads, state, params)
    >>> float(updates["w"][0]) < 0                            # a step against the gradient
    True
"""
from __future__ import annotations

import dataclasses

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW hyper-parameters; the schedule warms up linearly to `learning_rate` over
    `warmup_steps`, then decays by a cosine to `learning_rate * final_fraction` at
    `total_steps`."""

    learning_rate: float = 3e-3
    warmup_steps: int = 50
    total_steps: int = 1000
    final_fraction: float = 0.05
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    b2: float = 0.98


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Warmup + cosine learning-rate schedule (a function of the step)."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=max(cfg.warmup_steps, 1),
        decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.final_fraction)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip_by_global_norm, then AdamW (decoupled weight decay on matrices only)."""
    decay_mask = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)  # noqa
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(make_schedule(cfg), b2=cfg.b2, weight_decay=cfg.weight_decay,
                    mask=decay_mask))
