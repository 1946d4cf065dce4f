"""Layer lookup for SPEAR: the attacked `nn.Linear` by module name (never by parameter position)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class ReluLinear:
    """A `nn.Linear` found by name, with what is known about the activation that follows it."""

    name: str
    module: nn.Linear
    #: True: a ReLU follows (next module of an nn.Sequential, or a TransformerEncoderLayer's linear1
    #: with ReLU activation); False: something else follows; None: cannot tell from the structure.
    followed_by_relu: bool | None

    @property
    def weight_name(self) -> str:
        return f"{self.name}.weight"

    @property
    def bias_name(self) -> str:
        return f"{self.name}.bias"


def _is_relu(module: Any) -> bool:
    return isinstance(module, nn.ReLU) or module is torch.relu or module is nn.functional.relu


def relu_linear_layer(model: nn.Module, name: str) -> ReluLinear:
    """The `nn.Linear` called `name` in `model` (e.g. "layers.0", "encoder.layers.0.linear1").

    Raises KeyError for an unknown name and TypeError when the module is not a Linear with a bias.
    """
    modules = dict(model.named_modules())
    if name not in modules:
        linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
        raise KeyError(f"no module named {name!r}; Linear modules: {linears[:20]}")
    module = modules[name]
    if not isinstance(module, nn.Linear):
        raise TypeError(f"module {name!r} is a {type(module).__name__}, SPEAR needs an nn.Linear")
    if module.bias is None:
        raise TypeError(f"module {name!r} has no bias; SPEAR needs the bias gradient for scale and sign")
    parent_name, _, child = name.rpartition(".")
    parent = modules.get(parent_name) if parent_name else model
    followed: bool | None = None
    if isinstance(parent, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer) and child == "linear1":
        followed = _is_relu(parent.activation)
    elif isinstance(parent, nn.Sequential):
        children = list(parent.named_children())
        position = [n for n, _ in children].index(child)
        following = [m for _, m in children[position + 1 :] if not isinstance(m, nn.Dropout | nn.Identity)]
        followed = bool(following) and _is_relu(following[0])
    return ReluLinear(name, module, followed)


def attack_layer(spear, layer: ReluLinear, gradients: dict[str, torch.Tensor], rows: int | None,
                 prior: torch.Tensor | None = None):
    """SPEAR (`exact.spear.Spear`) on `layer` of one update: `gradients` {parameter name: gradient} holds its weight
    gradient (and bias gradient, which fixes scale and sign); `rows`: the layer-input rows of the update (None: the
    numerical rank). The layer's weight and bias enable the certificate. The one call the callback and the
    `exact.interface.SpearAttack` share."""
    if layer.weight_name not in gradients:
        raise KeyError(f"{layer.weight_name!r} is not among the observed parameters")
    return spear.attack(gradients[layer.weight_name], gradients.get(layer.bias_name), batch_size=rows,
                        weight=layer.module.weight, bias=layer.module.bias, prior=prior)
