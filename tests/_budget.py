"""How many examples the heaviest property tests draw: `examples(n)` keeps `n` in the
default profile (each example compiles several programs) and leaves the `thorough`
profile's many to `HYPOTHESIS_PROFILE=thorough`."""

import os

from hypothesis import settings

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def examples(default: int):
    """A `hypothesis.settings` decorator: `default` examples, or the profile's own under thorough."""
    return settings() if THOROUGH else settings(max_examples=default)
