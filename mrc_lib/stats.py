"""Significance of a difference between two settings trained with several seeds each."""

from __future__ import annotations

import math

import numpy as np
from mpmath import betainc  # a dependency of torch (through sympy)


def welch_t_test(a, b) -> tuple[float, float, float]:
    """Welch's two-sample t-test of ``mean(a) == mean(b)`` (unequal variances):
    ``t = (ā − b̄) / √(s_a²/n_a + s_b²/n_b)`` with the Welch–Satterthwaite degrees of freedom
    ``ν``, and the two-sided p-value :func:`t_two_sided_p`.
    Returns ``(t, ν, p)``; ``p`` is NaN when either sample has fewer than two values or both
    have zero variance."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or len(b) < 2:
        return math.nan, math.nan, math.nan
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        return math.nan, math.nan, math.nan
    t = (a.mean() - b.mean()) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return float(t), float(df), t_two_sided_p(t, df)


def t_two_sided_p(t: float, df: float) -> float:
    """``P(|T_ν| ≥ |t|)`` for Student's t with ``ν`` degrees of freedom:
    ``I_{ν/(ν+t²)}(ν/2, 1/2)``, the regularized incomplete beta function."""
    return float(betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))


def significance_mark(p: float, levels: tuple[float, float] = (0.05, 0.01)) -> str:
    """``"‡"`` below the second level, ``"†"`` below the first, else ``""`` (NaN: ``""``)."""
    if not p < levels[0]:
        return ""
    return "‡" if p < levels[1] else "†"
