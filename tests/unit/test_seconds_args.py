"""The driver API's arguments in seconds are checked before the call does anything:
finite numbers > 0 (>= 0 for shutdown's), else ConfigurationError naming the argument
(a NaN feed_timeout used to reach the feed tasks and fail there with a JSON error; a
negative shutdown timeout tore the cluster down before raising a ValueError)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tfos._driver.cluster import _check_seconds
from tfos.errors import ConfigurationError


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, -math.inf, True, "60", None])
def test_bad_seconds_are_refused_with_the_argument_named(value):
    with pytest.raises(ConfigurationError) as info:
        _check_seconds("train(): feed_timeout", value)
    assert str(info.value) == f"train(): feed_timeout must be a finite number of seconds > 0, got {value!r}"


@pytest.mark.parametrize("value", [0.001, 1, 600, 259200.0, np.int64(60), np.float32(0.5)])
def test_good_seconds_pass(value):
    _check_seconds("feed_timeout", value)


def test_zero_is_allowed_where_the_call_says_so():
    _check_seconds("shutdown(): timeout", 0, allow_zero=True)
    with pytest.raises(ConfigurationError, match=r"shutdown\(\): timeout must be a finite number of seconds >= 0, got -5"):
        _check_seconds("shutdown(): timeout", -5, allow_zero=True)
