"""Which attention kernel the vmap engines run under.

On CUDA, `scaled_dot_product_attention` picks a fused kernel (flash or memory-efficient attention).
Their backward does not survive `torch.func.vmap` over per-example weight copies: on an H100 with
torch 2.11 the generic per-example path failed with "LSE is not correctly aligned (strideH)"
(benchmarks/results/lti_gpu_h100.md). The math kernel is plain matrix products and a softmax, which
vmap batches like any other op, so the vmap engines run under it on CUDA. The specialised Transformer3
engine batches without vmap and keeps the fused kernels; CPUs keep their default kernels.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def vmap_safe_attention(device: torch.device | str) -> contextlib.AbstractContextManager:
    """The math attention kernel on CUDA, the default kernels elsewhere (a no-op context)."""
    if torch.device(device).type == "cuda":
        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()
