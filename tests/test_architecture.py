"""The house rules, checked over the whole tree (docs/design.md, "Package map"):

* imports run one way: the threat-model simulation and data (`datamodules`) at the bottom, the
  attacks (`exact`, the learned attack in `lti`) side by side above it, the workbench (CLI, grids,
  results) on top; no import cycle between modules;
* plain PyTorch components never import Lightning; only the thin wrappers do.

Imports are read from the source (every `import`, also inside functions and under
`if TYPE_CHECKING:`), so a lazy import or an annotation-only import that points the wrong way, or
closes a cycle, fails as well: a module that needs a type from a module above it should be handed
what it uses instead.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGES = ("datamodules", "exact", "lti")

#: Layer of every module, by the longest matching prefix. A module may import its own layer and below.
LAYERS = {
    "datamodules": 0,  # targets, client simulation, defenses, hashing, data, shared metrics
    "exact": 1,  # exact attacks (DAGER, SPEAR) and their callbacks
    # The learned attack, above the exact ones: the hybrid reads their server-side computations
    # (exact.span_evidence); an exact attack never reads the learned one.
    "lti.inverters": 2, "lti.loss": 2, "lti.module": 2, "lti.vision_module": 2, "lti.decoding": 2,
    "lti.evidence_prior": 2, "lti.candidates.pointer": 2, "lti.candidates.decoding": 2,
    "lti": 3,  # the workbench: CLI, grids, results writer
}
#: Modules that stand side by side: neither imports the other (none at present).
SIDE_BY_SIDE: tuple = ()

#: The Lightning wrappers: the only modules that may import lightning.
LIGHTNING_WRAPPERS = {
    "datamodules.inversion_data", "datamodules.text_inversion", "datamodules.vision_inversion",
    "exact.callbacks", "exact.callbacks.attacks", "exact.callbacks.base", "exact.callbacks.dager", "exact.callbacks.spear",
    "lti.module", "lti.vision_module", "lti.results", "lti.curves", "lti.trainer_cli",
    "lti.console", "lti.exact_only", "lti.final_validation", "lti.candidates.module",
}


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name an `import` statement in the file names (relative imports resolved), those
    under `if TYPE_CHECKING:` included: an import for annotations only is still an arrow between modules."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def project_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a.b import c` counts as `a.b.c` when that is a module)."""
    return {
        module: {name for name in imported_names(path, module) if name in modules and name != module}
        for module, path in modules.items()
    }


def layer_of(module: str) -> tuple[str, int]:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return prefix, LAYERS[prefix]


def test_imports_run_from_the_workbench_down_to_the_data():
    modules = project_modules()
    reversed_arrows = []
    for module, targets in project_imports(modules).items():
        _, level = layer_of(module)
        for target in targets:
            if layer_of(target)[1] > level:
                reversed_arrows.append(f"{module} (layer {level}) imports {target} (layer {layer_of(target)[1]})")
            for left, right in SIDE_BY_SIDE:
                for a, b in ((left, right), (right, left)):
                    a_match = any(module == p or module.startswith(p + ".") for p in ((a,) if isinstance(a, str) else a))
                    b_match = any(target == p or target.startswith(p + ".") for p in ((b,) if isinstance(b, str) else b))
                    if a_match and b_match:
                        reversed_arrows.append(f"{module} imports {target}: the attacks stand side by side")
    assert not reversed_arrows, "\n".join(sorted(reversed_arrows))


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """The import cycles of `graph` (module -> the modules it imports), each as "a -> b -> a"."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + "."):  # a package importing its own submodules is not an arrow back
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_there_is_no_import_cycle_between_modules():
    # Package __init__ files only re-export their own submodules; an edge into a package means its
    # __init__, so cycles through re-exports would show here too.
    cycles = import_cycles(project_imports(project_modules()))
    assert not cycles, "\n".join(cycles)


def test_the_cycle_check_catches_a_cycle_closed_under_type_checking(tmp_path):
    """A step module that imports its caller for an annotation only (`if TYPE_CHECKING:`) closes a cycle."""
    (tmp_path / "run.py").write_text("from pkg.step import search\n")
    (tmp_path / "step.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.run import Run\n\n\n"
        "def search(run: 'Run') -> None:\n    pass\n"
    )
    modules = {"pkg.run": tmp_path / "run.py", "pkg.step": tmp_path / "step.py"}
    graph = {module: {n for n in imported_names(path, module) if n in modules and n != module}
             for module, path in modules.items()}
    assert graph == {"pkg.run": {"pkg.step"}, "pkg.step": {"pkg.run"}}
    assert import_cycles(graph) == ["pkg.run -> pkg.step -> pkg.run"]


def test_the_layer_check_catches_a_reversed_arrow(tmp_path):
    """The checks above can fail: a data module that imports the learned attack is a reversed arrow."""
    fake = tmp_path / "m.py"
    fake.write_text("def f():\n    from lti.module import InversionModule\n")
    targets = {n for n in imported_names(fake, "datamodules.m") if n in project_modules()}
    assert "lti.module" in targets and layer_of("lti.module")[1] > layer_of("datamodules.m")[1]


def test_only_the_lightning_wrappers_import_lightning():
    modules = project_modules()
    offenders = [
        module for module, path in modules.items()
        if module not in LIGHTNING_WRAPPERS
        and any(name == "lightning" or name.startswith(("lightning.", "pytorch_lightning")) for name in imported_names(path, module))
    ]
    assert not offenders, offenders
    assert LIGHTNING_WRAPPERS <= set(modules), sorted(LIGHTNING_WRAPPERS - set(modules))


@pytest.mark.slow
def test_plain_pytorch_parts_do_not_import_lightning_transitively():
    plain = [m for m in project_modules() if m not in LIGHTNING_WRAPPERS and not m.endswith("__main__")]
    code = "import sys\n" + "".join(f"import {m}\n" for m in plain) + (
        "bad = [m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', 'pytorch_lightning'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=REPO)
