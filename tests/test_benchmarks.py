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


def test_inverter_loss_benchmark_times_both_layouts_and_they_agree(capsys):
    """benchmarks/inverter_loss.py times the flat and the transposed cross-entropy layouts on the same
    logits; the two compute the same loss and logit gradient."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("inverter_loss", REPO / "benchmarks" / "inverter_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--updates", "3", "--positions", "5", "--vocab", "101", "--repeats", "1"])
    assert [row["layout"] for row in rows] == list(module.LAYOUTS)
    assert all(row["seconds"] > 0 for row in rows)
    assert rows[1]["loss_rel_diff"] < 1e-6 and rows[1]["grad_max_diff"] < 1e-7
    printed = capsys.readouterr().out
    assert "| transposed (U, V, P) |" in printed
    with pytest.raises(SystemExit):
        module.main(["--positions", "0"])
