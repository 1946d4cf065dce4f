"""Where an update shows its inputs: one *site* per group of projections that read the same input (a Llama
layer's q/k/v projections all read the normalised hidden state), in model order.

LoRA (`adapter_sites`): at every site the rows of each adapter's lora_A gradient lie in the span of the inputs
of the batch's tokens there: for a projection W + s B A, dL/dA = s B^T sum_n delta_n x_n^T. lora_B's gradient
has rank r and adds nothing to a span test. A site's `rows(update)` stacks its adapters' lora_A gradients
(2r x d for q and v).

Full weights (`wide_sites`): a weight's gradient sum_n delta_n x_n^T has rank at most min(tokens, outputs,
inputs), so once a batch has more tokens than the model is wide every projection's span is full in its input
space, except where the input is wider than the output: an MLP's down-projection (GPT-2 12 x 768: inputs of
3,072, rank 768). There the gradient's 768 rows are combinations of the batch's inputs, as a LoRA site's
lora_A rows are, and the same graded span test reads them.

`capture_site_inputs(model, sites, run)` reads the sites' inputs from a forward pass (hooks on the modules).
Plain PyTorch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

#: Projections that read one shared input (the attention's normalised hidden state).
SHARED_INPUT = ("q_proj", "k_proj", "v_proj", "query", "key", "value")
_LORA_A = re.compile(r"^(?P<module>.+)\.lora_A\.(?P<adapter>[^.]+)\.weight$")


@dataclass(frozen=True)
class Site:
    """Projections reading one input: the modules (to hook) and the parameters whose gradient rows lie in the span
    of the inputs (lora_A weights, or nn.Linear weights (out, in)); `transposed`: the parameters are stored
    (in, out), as Hugging Face's Conv1D (GPT-2) stores them, so their gradients' columns are the rows."""

    modules: tuple[str, ...]
    weights: tuple[str, ...]
    transposed: bool = False

    def rows(self, update: Mapping[str, Tensor]) -> Tensor:
        """(rows, d): the parameters' gradients stacked as rows of the input space; every row lies in the span of
        the inputs."""
        parts = [update[name].reshape(update[name].shape[-2], -1) for name in self.weights]
        return torch.cat([p.T if self.transposed else p for p in parts], dim=0)


def adapter_sites(names: list[str]) -> list[Site]:
    """The sites of the observed parameter names, in the order the model runs them.

    Raises ValueError when no lora_A weight is observed (a model without readable adapters)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    order: list[str] = []
    for name in names:
        found = _LORA_A.match(name)
        if found is None:
            continue
        module = found["module"]
        parent, _, leaf = module.rpartition(".")
        key = parent if leaf in SHARED_INPUT else module
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((module, name))
    if not groups:
        raise ValueError("the batched attack reads LoRA adapters' lora_A gradients; the update has none "
                         "(observe a LoRAClient's adapters)")
    return [Site(tuple(m for m, _ in groups[k]), tuple(n for _, n in groups[k])) for k in order]


def wide_sites(model: nn.Module, names: list[str]) -> list[Site]:
    """The full-weight sites of the observed parameter names `names`: every observed weight of an nn.Linear or a
    Conv1D whose input is wider than its output (GPT-2's and Llama's MLP down-projections), one site each, in the
    order the model runs them (its module order).

    Raises ValueError when none is observed (a model whose every projection is as wide as its output)."""
    observed = set(names)
    sites = []
    for module_name, module in model.named_modules():
        weight = f"{module_name}.weight"
        if weight not in observed:
            continue
        if isinstance(module, nn.Linear):
            inputs, outputs, transposed = module.in_features, module.out_features, False
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            inputs, outputs, transposed = module.weight.shape[0], module.weight.shape[1], True  # stored (in, out)
        else:
            continue
        if inputs > outputs:
            sites.append(Site((module_name,), (weight,), transposed))
    if not sites:
        raise ValueError("a full-weight batched attack reads projections whose input is wider than their output "
                         "(an MLP's down-projection); none of the observed weights is one")
    return sites


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


class _SitesCaptured(Exception):
    """Raised by the last wanted site's hook: the rest of the forward pass is not needed."""


@torch.no_grad()
def capture_site_inputs(model: nn.Module, sites: list[Site], run, upto: int | None = None) -> list[Tensor]:
    """Run `run()` (a forward of `model`) and return each site's input (..., d) as the model computed it.

    `upto`: only the first `upto` sites' inputs are wanted; the forward pass stops there (a key/value cache
    given to it is then left half-updated: pass a copy)."""
    wanted = sites if upto is None else sites[:upto]
    modules = dict(model.named_modules())
    captured: list[Tensor | None] = [None] * len(wanted)
    handles = []
    try:
        for i, site in enumerate(wanted):
            module = modules.get(site.modules[0])
            if module is None:
                raise ValueError(f"the model has no module {site.modules[0]!r} (the module of {site.weights[0]!r})")

            def hook(mod, args, kwargs, i=i):
                captured[i] = (args[0] if args else next(iter(kwargs.values()))).detach()
                if upto is not None and i == len(wanted) - 1:
                    raise _SitesCaptured

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        try:
            run()
        except _SitesCaptured:
            pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [sites[i].modules[0] for i, x in enumerate(captured) if x is None]
    if missing:
        raise ValueError(f"the forward pass never reached {missing[0]!r}")
    return [x for x in captured if x is not None]
