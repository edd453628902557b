"""communication_report: every collective kind is found with its size, in the lowered module
and in the compiled program; merged collectives show up as such; HLO text parsing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import COLLECTIVE_KINDS, CommReport, collectives_in_hlo, communication_report


def _mapped(fn, mesh, in_spec, out_spec=P()):
    return eqxpar.filter_shard_map(fn, mesh=mesh, in_specs=(in_spec,), out_specs=out_spec)


def test_every_kind_with_its_size():
    mesh = eqxpar.make_mesh(model=4)

    def local(x):  # x: this device's (8, 4) block
        reduced = jax.lax.psum(x, "model")  # (8, 4)
        gathered = jax.lax.all_gather(x, "model", tiled=True)  # (32, 4)
        scattered = jax.lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True)  # (2, 4)
        swapped = jax.lax.all_to_all(x, "model", 0, 0, tiled=True)  # (8, 4)
        shifted = jax.lax.ppermute(x, "model", [(i, (i + 1) % 4) for i in range(4)])  # (8, 4)
        total = reduced.sum() + gathered.sum() + scattered.sum() + swapped.sum() + shifted.sum()
        return total[None]

    x = jnp.arange(32 * 4, dtype=jnp.float32).reshape(32, 4)
    report = communication_report(_mapped(local, mesh, P("model"), P("model")), x)
    # The bytes convention: all-gather the gathered result, reduce-scatter the full operand
    # each device contributes (32 elements; it keeps 8), the others the array itself.
    want_elements = {
        "all-reduce": 32,
        "all-gather": 128,
        "reduce-scatter": 32,
        "all-to-all": 32,
        "collective-permute": 32,
    }
    (scatter,) = report.collectives("reduce-scatter", stage="lowered")
    assert scatter.result_elements == 8 and scatter.result_bytes == 32
    for kind, elements in want_elements.items():
        assert report.count(kind, stage="lowered") == 1, (kind, str(report))
        assert report.elements(kind, stage="lowered") == elements
        assert report.bytes(kind, stage="lowered") == 4 * elements  # float32
        # XLA may split or merge a collective, but it moves the same data.
        assert report.count(kind) >= 1 and report.elements(kind) == elements, (kind, str(report))
    group_sizes = {c.group_size for c in report.collectives(stage="lowered") if c.kind != "collective-permute"}
    assert group_sizes == {4}
    text = str(report)
    assert all(kind in text for kind in COLLECTIVE_KINDS) and "TOTAL" in text


def test_lowered_shows_what_the_code_asked_compiled_what_runs():
    """Seven psums issued together: seven all-reduces as lowered; XLA may combine them into
    one (on CPU it does, a tuple it annotates with `/*index=5*/`). The data is the same."""
    mesh = eqxpar.make_mesh(data=2, model=4)
    arrays = [jnp.ones((4 * (i + 1), 3)) for i in range(7)]
    f = eqxpar.filter_shard_map(
        lambda *xs: jax.lax.psum(xs, "model"),
        mesh=mesh,
        in_specs=tuple(P("model") for _ in arrays),
        out_specs=tuple(P() for _ in arrays),
    )
    report = communication_report(f, *arrays)
    assert report.count("all-reduce", stage="lowered") == 7
    assert 1 <= report.count("all-reduce") <= 7
    assert report.bytes(stage="lowered") == report.bytes() == sum(range(1, 8)) * 3 * 4
    assert {c.group_size for c in report.collectives()} == {4}  # the model axis only, not data


def test_bytes_follow_the_dtype():
    mesh = eqxpar.make_mesh(model=2)
    f = _mapped(lambda x: jax.lax.psum(x, "model"), mesh, P("model"))
    report = communication_report(f, jnp.ones((10, 3), jnp.bfloat16))
    assert report.elements(stage="lowered") == 15 and report.bytes(stage="lowered") == 30


def test_group_size_tells_the_axes_apart():
    mesh = eqxpar.make_mesh(data=2, model=4)
    f = _mapped(lambda x: jax.lax.psum(x, "data"), mesh, P(("data", "model")), P("model"))
    report = communication_report(f, jnp.ones((8,)))
    (op,) = report.collectives()
    assert op.kind == "all-reduce" and op.group_size == 2


def test_no_collectives():
    report = communication_report(lambda x: x * 2, jnp.ones(3))
    assert report.count() == 0 and report.count(stage="lowered") == 0 and report.bytes() == 0
    assert "TOTAL" in str(report)


def test_unknown_kind_or_stage():
    report = CommReport(compiled=(), lowered=())
    with pytest.raises(ValueError, match="unknown collective kind"):
        report.count("allreduce")
    with pytest.raises(ValueError, match="stage"):
        report.count(stage="optimized")


def test_hlo_text_parsing_async_pairs_and_groups():
    hlo = "\n".join(
        [
            "  %p = f32[16,8]{1,0} parameter(0)",
            (
                "  %ars = f32[16,8]{1,0} all-reduce-start(f32[16,8]{1,0} %p), channel_id=1, "
                "replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add"
            ),
            "  %ard = f32[16,8]{1,0} all-reduce-done(f32[16,8]{1,0} %ars)",
            (
                "  %ag = (bf16[4]{0}, bf16[16]{0}) all-gather(bf16[4]{0} %a, bf16[4]{0} %b), "
                "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}"
            ),
            "  ROOT %cp = s32[3]{0} collective-permute(s32[3]{0} %c), source_target_pairs={{0,1},{1,0}}",
            # A combined all-reduce of six arrays: XLA marks every fifth tuple element.
            (
                "  %comb = (f32[1]{0}, f32[2]{0}, f32[3]{0}, f32[4]{0}, f32[5]{0}, /*index=5*/f32[6]{0:S(1)}) "
                "all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f), replica_groups={{0,1}}, to_apply=%add"
            ),
            "  %add.1 = f32[] add(f32[] %x, f32[] %y)",
        ]
    )
    ops = collectives_in_hlo(hlo)
    assert [c.kind for c in ops] == ["all-reduce", "all-gather", "collective-permute", "all-reduce"]
    reduce_, gather_, permute, combined = ops
    assert combined.shapes == ((1,), (2,), (3,), (4,), (5,), (6,)) and combined.group_size == 2
    assert reduce_.shapes == ((16, 8),) and reduce_.bytes == 16 * 8 * 4 and reduce_.group_size == 4
    assert gather_.shapes == ((4,), (16,)) and gather_.bytes == 20 * 2 and gather_.group_size == 4
    assert permute.dtypes == ("s32",) and permute.group_size is None
    np.testing.assert_equal(permute.elements, 3)
