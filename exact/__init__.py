"""Exact gradient-inversion attacks (DAGER, SPEAR) run on the same observed updates as learned inversion.

Plain PyTorch: nothing here imports Lightning except `exact.callbacks`, which adapts the attacks
to Lightning evaluation loops. `SpearCallback` is exported lazily (PEP 562), so `import exact`
does not import Lightning.
"""

from exact.dager import Dager, DagerResult, SpanBasis, dager_attack, span_basis, token_distances
from exact.layers import DagerLayers, FirstLayerInput, ProjectionRef, find_layers
from exact.spear import ReluLinear, Spear, SpearResult, relu_linear_layer, sparsity_agreement

__all__ = [
    "Dager", "DagerResult", "DagerLayers", "FirstLayerInput", "ProjectionRef", "SpanBasis",
    "dager_attack", "find_layers", "span_basis", "token_distances",
    "ReluLinear", "Spear", "SpearResult", "SpearCallback", "relu_linear_layer", "sparsity_agreement",
]


def __getattr__(name: str):
    if name == "SpearCallback":  # Lightning only when asked for
        from exact.callbacks import SpearCallback

        return SpearCallback
    raise AttributeError(f"module 'exact' has no attribute {name!r}")
