"""The shared flag ranges: in-range text parses, anything else is a one-line argparse error."""

import argparse
import math

import pytest

from tessera.core.arg_types import (
    Bounded,
    fraction_below_one,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    top_p,
)


@pytest.mark.parametrize("kind, text, value", [
    (positive_int, "1", 1), (non_negative_int, "0", 0), (positive_float, "3e-4", 3e-4),
    (non_negative_float, "0", 0.0), (fraction_below_one, "0.95", 0.95), (top_p, "1", 1.0),
    (port, "65535", 65535), (port, "1", 1),
])
def test_values_in_range_parse(kind, text, value):
    assert kind(text) == value and type(kind(text)) is kind.kind


@pytest.mark.parametrize("kind, text, message", [
    (positive_int, "0", "must be >= 1, got 0"),
    (positive_int, "-5", "must be >= 1, got -5"),
    (positive_int, "2.5", "expected a whole number, got '2.5'"),
    (non_negative_int, "-1", "must be >= 0, got -1"),
    (positive_float, "0", "must be > 0, got 0"),
    (positive_float, "-1", "must be > 0, got -1"),
    (positive_float, "nan", "must be a finite number, got nan"),
    (positive_float, "inf", "must be a finite number, got inf"),
    (positive_float, "fast", "expected a number, got 'fast'"),
    (non_negative_float, "-0.1", "must be >= 0, got -0.1"),
    (fraction_below_one, "1", "must be in [0, 1), got 1"),
    (top_p, "0", "must be in (0, 1], got 0"),
    (port, "99999", "must be between 1 and 65535, got 99999"),
    (port, "0", "must be between 1 and 65535, got 0"),
])
def test_values_out_of_range_are_argparse_errors(kind, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        kind(text)
    assert str(err.value) == message


def test_problem_checks_parsed_values():
    assert positive_int.problem(3) is None
    assert positive_int.problem(0) == "must be >= 1, got 0"
    assert positive_float.problem(math.inf) == "must be a finite number, got inf"
    assert Bounded(int, high=3).problem(4) == "must be <= 3, got 4"
