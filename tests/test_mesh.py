import jax
import pytest
from jax.sharding import AxisType

import eqxpar


def test_make_mesh_names_sizes_and_auto_axes():
    mesh = eqxpar.make_mesh(data=2, model=4)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert tuple(mesh.axis_names) == ("data", "model")
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert list(mesh.devices.flat) == jax.devices()[:8]


def test_make_mesh_may_use_fewer_devices_and_explicit_axes():
    mesh = eqxpar.make_mesh(axis_type="explicit", data=2)
    assert mesh.axis_types == (AxisType.Explicit,)
    assert list(mesh.devices.flat) == jax.devices()[:2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(data=3, model=4), "needs 12 devices but only 8"),
        (dict(data=16), "needs 16 devices"),
        (dict(data=0), "positive integers"),
        (dict(), "at least one named axis"),
        (dict(axis_type="manual", data=2), "axis_type must be one of"),
    ],
)
def test_make_mesh_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        eqxpar.make_mesh(**kwargs)


def test_parse_mesh():
    assert eqxpar.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert list(eqxpar.parse_mesh(" model=8 ")) == ["model"]
    for bad, msg in [("data", "name=size"), ("data=2,data=2", "twice"), ("data=x", "positive"), ("", "at least one")]:
        with pytest.raises(ValueError, match=msg):
            eqxpar.parse_mesh(bad)


def test_simulate_cpu_devices_too_late_is_a_clear_error():
    jax.devices()  # the backend is running (conftest asked for 8)
    eqxpar.simulate_cpu_devices(8)  # same count: fine
    with pytest.raises(ValueError, match="came too late"):
        eqxpar.simulate_cpu_devices(4)
