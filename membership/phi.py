"""The phi of phi-accrual failure detection, and the earliest suspicion it
allows: pure arithmetic on numbers, used by the detector and by ``Config``
(which checks that a worker's fence stays below that earliest suspicion).

phi = -log10(P(a normal(mean, std) interval exceeds the silence so far)).
"""

from __future__ import annotations

import math

# Below this standardised distance the tail probability 0.5 * erfc(z) is a
# normal float; above it, erfc underflows, so log(erfc(z)) comes from its
# asymptotic series, which at this distance is already exact to double
# precision (the first omitted term is below 1e-18).
_ERFC_TAIL_START = 20.0
# Beyond this distance z * z would overflow; phi is flat there (about 4e299),
# which keeps it finite and non-decreasing.
_Z_MAX = 1e150
_LN10 = math.log(10.0)
_LN2 = math.log(2.0)
_HALF_LN_PI = 0.5 * math.log(math.pi)
# Coefficients (2k - 1)!! of the asymptotic series
# erfc(z) ~ exp(-z^2) / (z sqrt(pi)) * sum_k (-1)^k (2k - 1)!! / (2 z^2)^k.
_TAIL_SERIES = (1.0, 1.0, 3.0, 15.0, 105.0, 945.0, 10395.0, 135135.0, 2027025.0)


def phi(elapsed: float, mean: float, std: float) -> float:
    """-log10 of the probability that a normal(mean, std) interval exceeds
    ``elapsed``; finite and non-decreasing in ``elapsed``."""
    z = min((elapsed - mean) / (std * math.sqrt(2.0)), _Z_MAX)
    if z < _ERFC_TAIL_START:
        # 0.0 - x turns the -0.0 of a certain arrival into 0.0.
        return 0.0 - math.log10(0.5 * math.erfc(z))
    inv_2z2 = 1.0 / (2.0 * z * z)
    series = 0.0
    for k, coefficient in enumerate(_TAIL_SERIES):
        series += (-1.0) ** k * coefficient * inv_2z2**k
    ln_erfc = -z * z - math.log(z) - _HALF_LN_PI + math.log(series)
    return (_LN2 - ln_erfc) / _LN10


def earliest_suspicion(threshold: float, min_std: float, max_silence: float) -> float:
    """The shortest silence after which any member may be suspected, whatever
    its heartbeat history: no member silent for less is ever suspected.

    phi grows with the silence minus the mean interval, over the standard
    deviation; the mean is at least 0 and the deviation at least
    ``min_std``, so the earliest case is a mean of 0 (every session
    message counts as a heartbeat, so the mean can fall well below
    ``heartbeat_interval``) at the floor: about 5.6 x ``min_std``
    (1.40 s by default), and never later than ``max_silence``."""

    def suspected(silence: float) -> bool:
        return silence > max_silence or phi(silence, 0.0, min_std) > threshold

    lo, hi = 0.0, max_silence
    if suspected(lo):
        return 0.0
    if not suspected(hi):
        return hi  # suspected only past max_silence
    while True:
        mid = lo + (hi - lo) / 2.0
        if mid <= lo or mid >= hi:
            return hi
        if suspected(mid):
            hi = mid
        else:
            lo = mid
