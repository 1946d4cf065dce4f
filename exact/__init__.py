"""Exact gradient-inversion attacks (DAGER) run on the same observed updates as learned inversion.

Plain PyTorch: nothing here imports Lightning except `exact.callbacks`, which adapts the attacks
to Lightning evaluation loops.
"""

from exact.dager import Dager, DagerResult, SpanBasis, dager_attack, span_basis, token_distances
from exact.layers import DagerLayers, FirstLayerInput, ProjectionRef, find_layers

__all__ = [
    "Dager", "DagerResult", "DagerLayers", "FirstLayerInput", "ProjectionRef", "SpanBasis",
    "dager_attack", "find_layers", "span_basis", "token_distances",
]
