"""How many examples the heaviest property tests draw: `examples(n)` keeps `n` in the
default profile (each example compiles several programs) and leaves the `thorough`
profile's many to `HYPOTHESIS_PROFILE=thorough`."""

import os

import pytest
from hypothesis import Phase, settings

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


PINS_ONLY = settings() if THOROUGH else settings(phases=(Phase.explicit,))
"""A `hypothesis.settings` decorator: only the `@example` pins by default, the profile's
draws too under thorough."""


def examples(default: int):
    """A `hypothesis.settings` decorator: `default` examples, or the profile's own under thorough."""
    return settings() if THOROUGH else settings(max_examples=default)


def case(*values, default: bool, id: str | None = None):
    """A `pytest.param` of `values` that the default run takes when `default`, else only
    the thorough one (marked `thorough`): for parametrized cases that each compile."""
    return pytest.param(*values, marks=() if default else pytest.mark.thorough, id=id)
