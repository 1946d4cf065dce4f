"""The exact attacks' options come in groups: nested in configs and the CLI, derived with `with_options`."""

from __future__ import annotations

import pytest
import torch
from jsonargparse import ArgumentError, ArgumentParser

from exact import Dager, Spear
from exact.dager import DagerOptions, EncoderOptions, RelaxedFill, SpanTests
from exact.spear import PriorGuidance, SearchBudget


def test_default_groups_hold_the_defaults():
    options = Dager().options
    assert options == DagerOptions()
    assert (options.span.l1_threshold, options.span.l2_threshold, options.span.torch_dtype) == (1e-3, 1e-3, torch.float64)
    assert (options.encoder.token_budget, options.relaxed.span_fraction, options.extensions.peel) == (2_000_000, 0.91, True)


def test_with_options_changes_fields_of_one_group_and_leaves_the_attack_alone():
    attack = Dager(encoder=EncoderOptions(eos_token_id=7))
    looser = attack.with_options(span={"l1_threshold": 1e-2, "l2_threshold": 1e-2})
    assert (looser.options.span.l1_threshold, looser.options.span.l2_threshold) == (1e-2, 1e-2)
    assert looser.options.span.rank_tol == attack.options.span.rank_tol
    assert looser.options.encoder is attack.options.encoder  # unchanged groups are shared (frozen)
    assert attack.options.span == SpanTests()  # the attack it was derived from is unchanged
    assert looser._layers is attack._layers  # the per-model layer lookup is shared too
    whole = attack.with_options(relaxed=RelaxedFill(enabled=False))
    assert whole.options.relaxed.enabled is False and whole.options.encoder.eos_token_id == 7


@pytest.mark.parametrize("changes,message", [
    ({"spans": {"l1_threshold": 1e-2}}, "no option group 'spans'"),
    ({"span": {"l1": 1e-2}}, "span has no option 'l1'"),
    ({"span": RelaxedFill()}, "expected a SpanTests"),
    ({"span": {"l1_threshold": 0.0}}, "l1_threshold=0.0 must be"),
])
def test_with_options_rejects_unknown_names_and_bad_values_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as error:
        Dager().with_options(**changes)
    assert "\n" not in str(error.value)


def test_values_are_cast_to_their_declared_types():
    span = SpanTests(l1_threshold=1, min_codimension=4.0)
    assert isinstance(span.l1_threshold, float) and isinstance(span.min_codimension, int)
    assert PriorGuidance(rows=[1, 2]).rows == (1.0, 2.0)
    with pytest.raises(ValueError, match="max_samples"):
        SearchBudget(max_samples=0)


def test_the_cli_parses_nested_groups_and_keeps_the_other_defaults():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Dager, "dager")
    parser.add_class_arguments(Spear, "spear")
    config = parser.parse_args(["--dager.span.l2_threshold", "0.01", "--dager.relaxed.enabled", "false",
                                "--spear.budget.max_seconds", "20"])
    objects = parser.instantiate_classes(config)
    dager, spear = objects.dager, objects.spear
    assert dager.options.span == SpanTests(l2_threshold=0.01)
    assert dager.options.relaxed == RelaxedFill(enabled=False)
    assert dager.options.encoder == EncoderOptions()
    assert spear.options.budget == SearchBudget(max_seconds=20.0) and spear.options.guidance == PriorGuidance()
    with pytest.raises(ArgumentError):  # the flat names of before are unknown options
        parser.parse_args(["--dager.l2_threshold", "0.01"])
