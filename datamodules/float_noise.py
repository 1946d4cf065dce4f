"""Equal up to float32 recomputation noise: the one test of "the same floats, computed again".

A float32 value computed again (another batch size, another thread count, another processor's SIMD
width or fused multiply-adds, another CUDA kernel) may differ in its last bits: a sum of n terms
carries a rounding error of about eps * sqrt(n) times the terms' magnitude (eps = 2^-23, float32's
resolution; the random-walk estimate, a factor of sqrt(n) below the worst case). An entry near zero
that is the difference of large terms keeps an error of the size of the large terms, so an error is
measured against the largest magnitude of what is compared (a row, a matrix), never against the
entry itself: `rtol` on a near-zero entry is what made CI fail on another processor (issue 43).

`same_up_to_float_noise(first, second, terms=n)` accepts a difference of at most
`NOISE_FACTOR * eps * sqrt(n) * scale` (scale: the largest magnitude of either operand, over the whole
tensors or per slice along `dim`); a real difference (another token, another sequence, dropout) moves
values by a sizeable part of that scale and is refused. Plain PyTorch; imported by the datamodules,
the exact attacks, the LTI modules and the benchmarks alike.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: float32's resolution (2^-23): the spacing of float32 values just above 1.
EPS32 = float(torch.finfo(torch.float32).eps)
#: Headroom over the sqrt(n) estimate: depth (a gradient passes through several matrix products), the
#: spread of rounding errors and kernels that sum in blocks of other sizes. A real difference is
#: millions of units away (a relative change of 1e-1 is ~1e6 eps), so the factor costs no power.
NOISE_FACTOR = 64.0


def float_noise_tolerance(terms: int = 1, factor: float = NOISE_FACTOR, floor: float = 0.0) -> float:
    """The largest difference, relative to the largest magnitude compared, that counts as float32 noise of
    a computation summing `terms` products per value (at least `floor`: a tolerance documented elsewhere)."""
    return max(factor * EPS32 * math.sqrt(max(int(terms), 1)), float(floor))


def float_noise_units(first: Tensor, second: Tensor, terms: int = 1, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """How far apart two computations of the same values are, in units of eps * sqrt(terms) * scale (scale:
    the largest magnitude of either over the tensors, or over `dim` per slice); float64. Equal tensors,
    zeros included, are 0 units apart; a difference where both are zero is infinitely many."""
    a, b = first.detach().double(), second.detach().double()
    difference = (a - b).abs()
    scale = torch.maximum(a.abs(), b.abs())
    if dim is None:
        difference, scale = difference.max(), scale.max()
    else:
        difference, scale = difference.amax(dim=dim), scale.amax(dim=dim)
    unit = EPS32 * math.sqrt(max(int(terms), 1)) * scale
    return torch.where(difference == 0, torch.zeros_like(difference), difference / unit)


def same_up_to_float_noise(first: Tensor, second: Tensor, terms: int = 1, dim: int | tuple[int, ...] | None = None,
                           factor: float = NOISE_FACTOR, floor: float = 0.0) -> bool:
    """Whether `second` is `first` computed again: equal shapes, no nan or inf in either, and every difference
    at most `float_noise_tolerance(terms, factor, floor)` times the largest magnitude of the operands (over
    the whole tensors, or per slice along `dim`). `terms`: the products summed into each value (the length
    of the reductions it went through: positions times width for a gradient)."""
    if first.shape != second.shape:
        return False
    if first.numel() == 0:
        return True
    if not (bool(torch.isfinite(first).all()) and bool(torch.isfinite(second).all())):
        return False
    limit = float_noise_tolerance(terms, factor, floor) / (EPS32 * math.sqrt(max(int(terms), 1)))
    return bool((float_noise_units(first, second, terms, dim) <= limit).all())


def one_ulp_up(tensor: Tensor) -> Tensor:
    """Each value moved to the next representable value of its dtype towards +inf: the smallest change a
    recomputation can make (what the tests perturb inputs by)."""
    return torch.nextafter(tensor, torch.full_like(tensor, math.inf))
