"""The spread of a few numbers, such as one metric over seed repeats: mean, sample standard deviation and
the 95% interval of the mean by Student's t. No scipy: for a whole number of degrees of freedom the t
distribution's P(|T| <= t) is a finite sum (Abramowitz and Stegun 26.7.3, 26.7.4), inverted here by
bisection to float precision: the quantile is exact for any n, at a cost that grows with n (about 1 ms at
n = 100, 2 s at 100,000)."""

from __future__ import annotations

import math


def spread(values: list[float]) -> dict:
    """n, mean, std (sample: over n - 1), the 95% interval of the mean (low, high), min and max. One value
    has no spread: its std and interval are None."""
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((value - mean) ** 2 for value in values) / (n - 1)) if n > 1 else None
    half = t_quantile(0.975, n - 1) * std / math.sqrt(n) if n > 1 else None
    return {"n": n, "mean": mean, "std": std, "low": None if half is None else mean - half,
            "high": None if half is None else mean + half, "min": min(values), "max": max(values)}


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p, for Student's t with `df` degrees of freedom (a whole number >= 1), p in
    [0.5, 1): the angle theta = atan(t / sqrt(df)) that gives P(|T| <= t) = 2p - 1, found by bisection."""
    if not (df >= 1 and int(df) == df and 0.5 <= p < 1):
        raise ValueError(f"t_quantile needs a whole df >= 1 and p in [0.5, 1), got df {df}, p {p}")
    target, low, high = 2 * p - 1, 0.0, math.pi / 2
    for _ in range(200):  # the interval halves each time: float precision long before 200
        middle = (low + high) / 2
        if middle in (low, high):
            break
        low, high = (middle, high) if t_within(middle, int(df)) < target else (low, middle)
    return math.sqrt(df) * math.tan((low + high) / 2)


def t_within(theta: float, df: int) -> float:
    """P(|T| <= sqrt(df) tan(theta)) for Student's t with `df` degrees of freedom, summed in closed form:
    odd df, (2/pi)(theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)); even df, sin (1 + 1/2 cos^2 +
    1*3/(2*4) cos^4 + ...); each sum has df // 2 - 1 terms after its first."""
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0
    for k in range(1, df // 2):
        term *= cos2 * (2 * k - 1 + df % 2) / (2 * k + df % 2)  # odd: 2k / (2k + 1); even: (2k - 1) / 2k
        total += term
    if df % 2:
        return 2 / math.pi * (theta + sin * math.sqrt(cos2) * total)
    return sin * total
