"""Replica groups in every form XLA prints, mapped back to mesh axes; named-scope (layer)
attribution; one input convention for the communication and memory reports.

The fixtures in tests/hlo_fixtures/ are collective lines of real compiled programs
(`capture.py` there regenerates them); the expected axes come from what each program does.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import CommReport, collectives_in_hlo, communication_report, memory_report
from eqxpar.inspect._hlo import _stablehlo_mesh_axes_groups

FIXTURES = pathlib.Path(__file__).parent / "hlo_fixtures"


def _mesh(shape: dict, order=None) -> Mesh:
    devices = np.array(jax.devices())[order if order is not None else slice(None)]
    return Mesh(devices.reshape(tuple(shape.values())), tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def _found(name: str, mesh: Mesh) -> list:
    text = (FIXTURES / f"{name}.hlo").read_text()
    return [(c.kind, c.axes(mesh), c.group_size, c.scope) for c in collectives_in_hlo(text)]


def test_plain_jit_iota_and_mesh_forms():
    text = (FIXTURES / "jit_data2_model4.hlo").read_text()
    assert "<=[8]" in text and "replica_groups=mesh[" in text  # both forms, one program
    assert _found("jit_data2_model4", _mesh({"data": 2, "model": 4})) == [
        ("all-reduce", ("data",), 2, "total"),  # sum over the rows split on data
        ("all-reduce", ("model",), 4, "matmul"),  # partial products over model
        ("all-gather", ("model",), 4, "gather"),  # to replicated: gather model, then data
        ("all-gather", ("data",), 2, "gather"),
    ]


def test_mesh_form_with_device_ids_on_three_axes():
    # XLA's own mesh (axis_0=4, axis_1=2, devices transposed) is not the user's a, b, c.
    assert "device_ids=([2,2,2]T(0,2,1))" in (FIXTURES / "jit_a2_b2_c2.hlo").read_text()
    assert _found("jit_a2_b2_c2", _mesh({"a": 2, "b": 2, "c": 2})) == [
        ("all-reduce", ("a", "c"), 4, "outer/inner"),  # rows split over (a, c)
        ("all-gather", ("b",), 2, "outer/inner"),  # columns split over b
    ]


def test_mesh_form_on_a_mesh_in_another_device_order():
    # Device ids are positions in the mesh, whatever devices sit there.
    mesh = _mesh({"data": 2, "model": 4}, order=[0, 2, 4, 6, 1, 3, 5, 7])
    assert _found("jit_permuted_data2_model4", mesh) == [
        ("all-reduce", ("data",), 2, ""),
        ("all-gather", ("model",), 4, ""),
    ]


def test_explicit_lists_from_shard_map():
    ops = collectives_in_hlo((FIXTURES / "shard_map_data2_model4.hlo").read_text())
    mesh = _mesh({"data": 2, "model": 4})
    assert [(c.kind, c.axes(mesh), c.group_size) for c in ops] == [
        ("all-gather", ("data",), 2),
        ("reduce-scatter", ("model",), 4),
        ("all-reduce", ("model",), 4),
    ]
    assert ops[1].bytes == 4 * ops[1].result_bytes  # the operand each device contributes


@pytest.mark.parametrize(
    "groups, want",
    [
        ("mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),  # 8 -> [2, 2, 2], middle
        ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),  # outer and inner
        ("mesh['x'=2,'y'=4] {'y','x'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),  # both: one group
        ("mesh['x'=2,'y'=4] {}", tuple((d,) for d in range(8))),  # no axes: one device each
        # devices [[0,4,1,5],[2,6,3,7]] on XLA's mesh: groups down its columns
        ("mesh[x=2,y=4], device_ids=(0,4,1,5,2,6,3,7) {x}", ((0, 2), (4, 6), (1, 3), (5, 7))),
        ("mesh['x'=2,'y'=4], device_ids=([4,2]T(1,0)) {'y'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ],
)
def test_mesh_form_variants(groups, want):
    (op,) = collectives_in_hlo(f"  %r = f32[4]{{0}} all-reduce(%p), replica_groups={groups}, to_apply=%add")
    assert op.replica_groups == want and op.group_size == len(want[0])


# JAX 0.11 lowers shard_map's collectives with replica groups naming mesh axes, over the
# module's `sdy.mesh` declarations (the texts below are JAX 0.11.2's, on a data=2, model=4 mesh).
SDY_MESHES = {
    "mesh": 'sdy.mesh @mesh = <["data"=2, "model"=4]> {stablehlo.mesh = {axes = []}}',
    "mesh_0": 'sdy.mesh @mesh_0 = <["data"=2, "model"=4]>',
    "permuted": 'sdy.mesh @permuted = <["data"=2, "model"=4], device_ids=[0, 2, 4, 6, 1, 3, 5, 7]>',
}


@pytest.mark.parametrize(
    "mesh, axes, want",
    [
        ("mesh_0", ["model"], ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("mesh_0", ["data"], ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("mesh_0", ["data", "model"], (tuple(range(8)),)),
        ("mesh_0", ["model", "data"], ((0, 4, 1, 5, 2, 6, 3, 7),)),
        # device ids are positions: the declared order puts devices 0, 2, 4, 6 on data=0
        ("permuted", ["model"], ((0, 2, 4, 6), (1, 3, 5, 7))),
    ],
)
def test_stablehlo_mesh_axes_form(mesh, axes, want):
    refs = ", ".join(f'#stablehlo.axis_ref<name = "{a}">' for a in axes)
    text = f"#stablehlo.replica_group_mesh_axes<mesh = @{mesh}, axes = [{refs}]>"
    assert _stablehlo_mesh_axes_groups(text, SDY_MESHES) == want


@pytest.mark.parametrize(
    "text",
    [
        '#stablehlo.replica_group_mesh_axes<mesh = @nowhere, axes = [#stablehlo.axis_ref<name = "model">]>',
        '#stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "m", sub = 2>]>',
    ],
)
def test_stablehlo_mesh_axes_form_it_cannot_read_is_an_error(text):
    with pytest.raises(ValueError, match="cannot read the replica groups"):
        _stablehlo_mesh_axes_groups(text, SDY_MESHES)


def test_mesh_form_names_an_unknown_axis():
    with pytest.raises(ValueError, match="axis 'z'"):
        collectives_in_hlo("  %r = f32[4]{0} all-reduce(%p), replica_groups=mesh['x'=8] {'z'}, to_apply=%add")


def test_plain_jit_with_named_shardings_report():
    """No shard_map: XLA's partitioner adds every collective; the report still names the
    mesh axes, group sizes and layers, whichever replica-group form this XLA prints."""
    mesh = _mesh({"data": 2, "model": 4})

    def f(x, w):
        with jax.named_scope("matmul"):
            y = x @ w
        with jax.named_scope("gather"):
            g = jax.lax.with_sharding_constraint(y * 2, NamedSharding(mesh, P()))
        with jax.named_scope("total"):
            t = jnp.sum(x, axis=0)
        return g, t

    x = jax.device_put(jnp.ones((16, 32)), NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(jnp.ones((32, 8)), NamedSharding(mesh, P("model", None)))
    report = communication_report(jax.jit(f), x, w)
    assert dict(report.mesh.shape) == {"data": 2, "model": 4}
    assert report.count(stage="lowered") == 0  # jit emits none; the partitioner adds them
    by = {(c.kind, c.axes(report.mesh), c.group_size, c.scope) for c in report.collectives()}
    assert ("all-reduce", ("model",), 4, "matmul") in by
    assert ("all-reduce", ("data",), 2, "total") in by
    assert {a for k, a, _, s in by if s == "gather"} <= {("data",), ("model",), ("data", "model")}
    # the matmul's partial sums: a (16/2) x 8 float32 block, over model only
    assert report.bytes("all-reduce", axes="model", scope="matmul") == 8 * 8 * 4
    assert report.count(axes="model", scope="total") == 0


def _layered(mesh):
    @jax.jit
    def shared(x):  # an inner jit, called twice: lowered once, counted per call
        with jax.named_scope("mlp"):
            return jax.lax.psum(x, "model")

    def local(x):
        def body(c, _):
            with jax.named_scope("step"):
                return jax.lax.psum(c, "model") * 0.5, None

        with jax.named_scope("attention"):
            a = jax.lax.psum(x * 2, "data")
        with jax.named_scope("loop"):
            b, _ = jax.lax.scan(body, x, None, length=3)
        return a + shared(x) + shared(b)

    f = eqxpar.filter_shard_map(local, mesh=mesh, in_specs=(P("model"),), out_specs=P("model"), check_vma=False)

    def outer(x):
        with jax.named_scope("block_0"):
            return jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)

    return outer


def test_named_scopes_say_which_layer_issued_each_collective():
    mesh = eqxpar.make_mesh(data=2, model=4)
    report = communication_report(_layered(mesh), jnp.ones((8,)))
    lowered = report.by_scope(stage="lowered")
    # One psum per call, forward and backward (psum's transpose here is a psum); the inner
    # jit twice; the scan body once per iteration (length 3) in each direction. The
    # shard_map's own backward psum (the cotangent of its input, replicated over data)
    # belongs to the enclosing scope.
    f32x2 = 2 * 4
    assert lowered == {
        "block_0/attention": (2, 2 * f32x2),
        "block_0/loop/step": (6, 6 * f32x2),
        "block_0/mlp": (4, 4 * f32x2),
        "block_0": (1, f32x2),
    }
    total = (report.count(stage="lowered"), report.bytes(stage="lowered"))
    assert report.by_scope(stage="lowered", depth=1) == {"block_0": total} and total[0] == 13
    assert report.count(scope="block_0", stage="lowered") == 13  # nested scopes included
    assert report.count(scope="block_0/loop", stage="lowered") == 6 and report.count(scope="", stage="lowered") == 0
    # Compiled: XLA knows the loops' trip counts too.
    assert report.count(scope="block_0/loop/step") == 6
    assert {c.axes(mesh) for c in report.collectives(scope="block_0/attention", stage="lowered")} == {("data",)}
    assert {c.axes(mesh) for c in report.collectives(scope="block_0/mlp", stage="lowered")} == {("model",)}
    # Compiled: XLA may combine or drop some, but each keeps the scopes it came from.
    compiled = {s for c in report.collectives() for s in c.scopes}
    assert {"block_0/attention", "block_0/mlp", "block_0/loop/step"} <= compiled <= set(lowered)
    assert "in block_0/" in str(report)
    with pytest.raises(ValueError, match="depth"):
        report.by_scope(depth=0)


@pytest.mark.parametrize(
    "op_name, scopes",
    [
        ("jit(step)/transpose(jvp(block_0))/shard_map/attention/psum", ("block_0/attention",)),
        ("jit(f)/blk/transpose(blk)/jvp()/shard_map/ck/ck/checkpoint/rematted_computation/psum", ("blk/ck",)),
        ("jit(f)/shard_map/a/(psum:jit(sub)/mlp/psum)", ("a", "a/mlp")),
        ("jit(f)/shard_map/b/loop/while/body/eval_jaxpr/step/psum", ("b/loop/step",)),  # JAX 0.11's scan body
        ("jit(flat_fn)/shard_map/transpose(jvp(vmap(vmap())))/psum_invariant", ()),
        (None, ()),
    ],
)
def test_scope_of_an_op_name(op_name, scopes):
    from eqxpar.inspect import Collective

    assert Collective("all-reduce", ((1,),), ("f32",), 2, op_name=op_name).scopes == scopes


def test_reports_take_the_same_inputs():
    mesh = eqxpar.make_mesh(data=8)
    x = eqxpar.shard(jnp.ones((16, 4)), mesh, P("data"))
    w = jnp.ones((4, 4))

    def step(w, opt_state, x):
        return jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w), opt_state

    jitted = jax.jit(step)
    lowered = jitted.lower(w, None, x)
    compiled = lowered.compile()
    reports = [
        communication_report(step, w, None, x),
        communication_report(jitted, w, None, x),
        communication_report(lowered),
    ]
    for r in reports:
        assert r.count("all-reduce", axes="data") >= 1 and r.bytes() == reports[0].bytes() > 0
    only_compiled = communication_report(compiled)
    assert only_compiled.lowered == () and only_compiled.bytes() == reports[0].bytes()
    assert dict(only_compiled.mesh.shape) == {"data": 8}
    memory = [memory_report(step, w, None, x), memory_report(jitted, w, None, x), memory_report(compiled, w, None, x)]
    assert all(m.parameters == w.nbytes and m.other_inputs * 8 == x.nbytes for m in memory)
    # The jit and its compiled program are one program; the plain function goes through
    # eqx.filter_jit, a program of its own (whose scratch XLA of JAX 0.11 sizes otherwise).
    assert memory[1].temporaries == memory[2].temporaries > 0
    with pytest.raises(ValueError, match="pass the program alone"):
        communication_report(lowered, w)
    with pytest.raises(ValueError, match="expected a function"):
        communication_report(42)
    with pytest.raises(ValueError, match="arguments"):
        memory_report(compiled)
    assert isinstance(CommReport.of(lowered, compiled), CommReport)


def test_the_gpt_theory_lives_beside_the_gpt():
    import eqxpar.inspect
    import eqxpar.models

    assert callable(eqxpar.models.gpt_tensor_parallel_theory)
    with pytest.raises(AttributeError, match="eqxpar.models.gpt_tensor_parallel_theory"):
        _ = eqxpar.inspect.gpt_tensor_parallel_theory
