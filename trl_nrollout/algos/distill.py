"""On-policy distillation inside RL: the teacher term on the advantages (pure functions).

The student samples; a teacher scores the sampled tokens. With ``s_t`` the student's (old-policy) log-prob of the
sampled token ``t`` and ``q_t`` the teacher's, ``s_t - q_t`` is the sampled-token estimate of the reverse KL
``KL(student || teacher)`` at that position, the estimate verl's, slime's and NeMo-RL's on-policy distillation use.
Subtracting ``coef * (s_t - q_t)`` from each token's advantage makes the policy gradient pull the student toward
the teacher wherever the teacher likes the token more than the student does: pure distillation with rewards off
(all advantages 0), mixed with any estimator's advantages otherwise (coefficient 0: the advantages unchanged).
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_kl_estimate(student_logps: Tensor, teacher_logps: Tensor, mask: Tensor) -> Tensor:
    """The sampled-token reverse KL estimate ``(s - q)`` ``[B, C]``, 0 where ``mask`` is 0 (padding, tool output,
    a masked truncated completion). All three ``[B, C]``."""
    return (student_logps.float() - teacher_logps.float()) * mask.to(torch.float32)


def teacher_advantages(advantages: Tensor, student_logps: Tensor, teacher_logps: Tensor, mask: Tensor,
                       coef: float) -> Tensor:
    """``advantages - coef * (s - q)`` on the tokens of ``mask``, unchanged elsewhere; ``[B, C]`` each, the
    result in ``advantages``' dtype. A token the teacher finds likelier than the student (``q > s``) gains
    advantage; one it finds unlikelier loses it."""
    if coef < 0:
        raise ValueError(f"the teacher term's coefficient must be >= 0, got {coef}")
    term = reverse_kl_estimate(student_logps, teacher_logps, mask)
    return (advantages.float() - coef * term).to(advantages.dtype)


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """The mean of ``values`` over ``mask``'s tokens (0.0 when it has none)."""
    m = mask.to(torch.float32)
    count = float(m.sum())
    return float((values.float() * m).sum()) / count if count else 0.0
