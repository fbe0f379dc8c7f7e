"""Distillation losses: forward KL(target || draft) on the teacher's full distribution
(temperature 1), plus an optional top-1 cross-entropy on the teacher's argmax.

Also the two numbers that predict speculative acceptance: top-1 agreement (greedy: a draft
token is accepted iff it is the target's argmax) and sum(min(p, q)) (sampling: the
probability that a draft token drawn from q is accepted).

Example:
    >>> import jax.numpy as jnp
    >>> teacher = jnp.log(jnp.array([[0.7, 0.2, 0.1]]))
    >>> loss, metrics = distill_loss(teacher, teacher, jnp.ones((1,)))
    >>> round(float(loss), 6), float(metrics["top1"]), round(float(metrics["overlap"]), 6)
    (0.0, 1.0, 1.0)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def distill_loss(student_logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
                 ce_weight: float = 0.0) -> tuple[jax.Array, dict]:
    """Mean over masked positions of KL(p_teacher || q_student) + ce_weight * CE(argmax p).

    student_logits, teacher_logits: [..., V] (any float dtype; computed in float32).
    mask: [...] 1 where a position counts. Returns (loss, {"kl", "ce", "top1", "overlap"}).
    """
    log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)  # [..., V]
    log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)  # [..., V]
    p = jnp.exp(log_p)  # [..., V]
    kl = jnp.sum(p * (log_p - log_q), axis=-1)  # [...]
    target = jnp.argmax(log_p, axis=-1)  # [...]
    ce = -jnp.take_along_axis(log_q, target[..., None], axis=-1)[..., 0]  # [...]
    top1 = (jnp.argmax(log_q, axis=-1) == target).astype(jnp.float32)  # [...]
    overlap = jnp.sum(jnp.minimum(p, jnp.exp(log_q)), axis=-1)  # [...]
    mask = mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    mean = lambda x: jnp.sum(x * mask) / count  # noqa: E731
    metrics = {"kl": mean(kl), "ce": mean(ce), "top1": mean(top1), "overlap": mean(overlap)}
    return metrics["kl"] + ce_weight * metrics["ce"], metrics
