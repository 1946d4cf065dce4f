"""(epsilon, delta) of a client's DP-SGD steps, from opacus' accountants.

The guarantee is record level (one sequence of one client) for that client's own local training:
`steps` noisy steps, each on a minibatch drawn with probability `sample_rate` per sequence. opacus'
analyses assume Poisson sampling; a client that shuffles and cuts its n sequences into minibatches
of b is accounted as sample rate b / n, as opacus itself does for shuffled loaders (an
approximation). One full-batch step (FedSGD) is sample rate 1: no amplification by subsampling.
"""

from __future__ import annotations

import math

#: Accountant names accepted by `dp_epsilon` (opacus' `create_accountant` mechanisms).
ACCOUNTANTS = ("rdp", "prv", "gdp")


def dp_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """epsilon of `steps` subsampled Gaussian steps (noise std = noise_multiplier x clip norm) at `delta`.

    Returns inf without noise (noise_multiplier = 0).
    """
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant {accountant!r} is not allowed; use one of {', '.join(ACCOUNTANTS)}")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"DP sample_rate={sample_rate} must be in (0, 1]")
    if steps < 1:
        raise ValueError(f"DP steps={steps} must be >= 1")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"DP delta={delta} must be in (0, 1)")
    if noise_multiplier < 0.0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"DP noise_multiplier={noise_multiplier} must be a finite number >= 0")
    if noise_multiplier == 0.0:
        return math.inf
    from opacus.accountants import create_accountant  # imported late: opacus is only needed for DP

    acc = create_accountant(accountant)
    acc.history.append((float(noise_multiplier), float(sample_rate), int(steps)))
    return float(acc.get_epsilon(delta=delta))
