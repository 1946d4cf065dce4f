"""Benchmarks that quote numbers in the docs: they run, and their derived columns follow from the measured ones."""

import pytest

from conftest import REPO


def test_update_scale_benchmark_prints_norm_ratios_that_follow_from_its_norms(monkeypatch, capsys):
    """benchmarks/update_scale.py builds a grid protocol's datamodule as `lti` does and measures its
    undefended updates; the ratio columns are the arithmetic of the printed norm and dimension."""
    import importlib.util
    import math

    monkeypatch.chdir(REPO)
    spec = importlib.util.spec_from_file_location("update_scale", REPO / "benchmarks" / "update_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--grid", "configs/matrix/issue5.yaml", "--protocols", "layer0_attn_out", "--updates", "2", "--sigma", "0.1"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| layer0_attn_out")]
    (cells,) = [[c.strip() for c in line.strip("|").split("|")] for line in row]
    dim, norm = int(cells[1].replace(",", "")), float(cells[2])
    assert dim == 96 * 96 + 96  # layer 0's attention output projection: weight and bias
    assert norm > 0 and float(cells[3]) == pytest.approx(norm / math.sqrt(dim), rel=1e-2)
    assert float(cells[4]) == pytest.approx(norm / (0.1 * math.sqrt(dim)), rel=1e-2)
    assert float(cells[5]) == pytest.approx(1 / (0.1 * math.sqrt(dim)), rel=1e-2)
