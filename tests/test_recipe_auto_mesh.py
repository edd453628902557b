"""`--mesh auto` (every recipe's default) and `eqxpar.fit_mesh`, the rule behind it: on 8
devices auto gives the meshes the recipes had as defaults before it; it shrinks axes to
what the batch and model must divide; fit_mesh reaches the largest mesh any size tuple
could (checked by trying every one)."""

import itertools
import math

import pytest
from _recipes import RECIPES, load_recipe
from hypothesis import given
from hypothesis import strategies as st

from eqxpar._mesh import fit_mesh

NAMES = sorted(p.stem for p in RECIPES.glob("*.py"))


# The meshes the recipes had as defaults before `auto`: on 8 devices auto chooses them.
EIGHT_DEVICE_DEFAULTS = {
    "data_loading": "data=2,model=4",
    "data_parallel": "data=8",
    "fsdp": "fsdp=8,model=1",
    "hybrid_gpt": "data=2,model=4",
    "llama": "data=2,model=4",
    "long_context": "data=2,context=2,model=2",
    "moe_gpt": "data=2,expert=4,model=1",
    "multihost": "data=8",
    "pipeline_gpt": "stage=4,data=2,model=1",
    "pmap_data_parallel": "data=8",
    "sharding_basics": "x=2,y=4",
    "tensor_parallel": "model=8",
    "three_ways": "x=8",
    "your_model": "data=2,model=4",
}


def test_every_recipe_has_its_eight_device_default():
    assert set(NAMES) <= set(EIGHT_DEVICE_DEFAULTS), sorted(set(NAMES) - set(EIGHT_DEVICE_DEFAULTS))


@pytest.mark.parametrize("name", NAMES)
def test_auto_mesh_on_eight_devices_is_the_old_default(name):
    recipe = load_recipe(name)
    assert recipe.Config().mesh == "auto"
    assert recipe.check_flags(recipe.Config()).mesh == EIGHT_DEVICE_DEFAULTS[name]


def test_auto_mesh_respects_what_it_must_divide():
    hybrid = load_recipe("hybrid_gpt")
    assert hybrid.check_flags(hybrid.Config(heads=2)).mesh == "data=4,model=2"
    assert hybrid.check_flags(hybrid.Config(batch_size=3, heads=1)).mesh == "data=3,model=1"
    dp = load_recipe("data_parallel")
    assert dp.check_flags(dp.Config(batch_size=24, grad_accum=4)).mesh == "data=6"


def best_product(preferred, n, divides):
    """The largest mesh size fit_mesh could reach, by trying every size tuple."""
    ranges = [range(1, n + 1) for _ in preferred]
    fits = (
        math.prod(sizes)
        for sizes in itertools.product(*ranges)
        if math.prod(sizes) <= n and all(divides.get(a, s) % s == 0 for a, s in zip(preferred, sizes))
    )
    return max(fits)


@given(
    preferred=st.dictionaries(st.sampled_from("abc"), st.sampled_from([1, 2, 4, 8]), min_size=1),
    n=st.integers(1, 12),
    limits=st.dictionaries(st.sampled_from("abc"), st.integers(1, 24)),
)
def test_fit_mesh_uses_the_most_devices_it_can(preferred, n, limits):
    divides = {a: d for a, d in limits.items() if a in preferred}
    sizes = fit_mesh(preferred, n, divides=divides)
    assert list(sizes) == list(preferred)
    assert math.prod(sizes.values()) <= n
    assert all(d % sizes[a] == 0 for a, d in divides.items())
    assert math.prod(sizes.values()) == best_product(preferred, n, divides)
    if math.prod(preferred.values()) == n and all(d % preferred[a] == 0 for a, d in divides.items()):
        assert sizes == preferred


def test_fit_mesh_errors():
    with pytest.raises(ValueError, match="at least one axis"):
        fit_mesh({}, 8)
    with pytest.raises(ValueError, match="not in"):
        fit_mesh({"data": 8}, 8, divides={"model": 4})
    with pytest.raises(ValueError, match="num_devices"):
        fit_mesh({"data": 8}, 0)
