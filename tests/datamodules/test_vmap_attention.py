"""The vmap engines on CUDA: fused attention kernels fail under vmap (benchmarks/results/lti_gpu_h100.md),
so the engines run attention through the math kernel there. The CUDA tests compare each vmap path with
its per-sequence loop on the GPU; they are skipped on machines without one (CI)."""

import contextlib

import pytest
import torch
from conftest import relative_error

from datamodules.federated import ParameterSelection
from datamodules.federated.engines.attention import vmap_safe_attention
from datamodules.federated.engines.next_token import (
    group_gradients_loop,
    group_gradients_vmap,
    per_example_gradients_loop,
    per_example_gradients_vmap,
)
from datamodules.targets import Transformer3

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_math_kernel_on_cuda_only():
    assert isinstance(vmap_safe_attention("cpu"), contextlib.nullcontext)
    assert isinstance(vmap_safe_attention(torch.device("cpu")), contextlib.nullcontext)
    assert not isinstance(vmap_safe_attention("cuda"), contextlib.nullcontext)  # building it needs no GPU


def _tiny_t3(causal: bool) -> Transformer3:
    return Transformer3(vocab_size=300, hidden_size=32, num_heads=4, ffn_size=64, num_layers=2, max_positions=8, causal=causal).eval()


@cuda
@pytest.mark.parametrize("causal", [False, True])
def test_transformer3_vmap_path_matches_the_loop_on_cuda(causal):
    model = _tiny_t3(causal).cuda()
    names = ParameterSelection().resolve(model)
    ids = torch.randint(0, 300, (5, 8), device="cuda")
    assert relative_error(per_example_gradients_vmap(model, names, ids), per_example_gradients_loop(model, names, ids)) < 1e-4


@cuda
def test_gpt2_vmap_path_matches_the_loop_on_cuda(tiny_gpt2):
    model = tiny_gpt2.eval().cuda()
    names = ParameterSelection().resolve(model)
    ids = torch.randint(0, 300, (4, 12), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    fast = per_example_gradients_vmap(model, names, ids, mask)
    assert relative_error(fast, per_example_gradients_loop(model, names, ids, mask)) < 1e-4


@cuda
def test_group_vmap_path_matches_the_loop_on_cuda():
    model = _tiny_t3(causal=False).cuda()
    names = ParameterSelection().resolve(model)
    ids = torch.randint(0, 300, (3, 2, 8), device="cuda")
    flat = torch.cat([dict(model.named_parameters())[n].detach().reshape(-1) for n in names])
    weights = flat.expand(3, -1) + 0.05 * torch.randn(3, flat.numel(), device="cuda")
    slow = group_gradients_loop(model, names, ids, None, weights)
    assert relative_error(group_gradients_vmap(model, names, ids, None, weights), slow) < 1e-4
