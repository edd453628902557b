"""eqxpar.recipe helpers shared by the recipes."""


def test_throughput_leaves_out_the_first_step():
    import time

    from eqxpar.recipe import Throughput

    meter = Throughput(per_step=100)
    meter.tick()  # the compiling step: starts the clock
    assert meter.per_second != meter.per_second  # NaN: nothing timed yet
    time.sleep(0.05)
    meter.tick()
    time.sleep(0.05)
    meter.tick()
    # Two timed steps of 100 items in about 0.1 s (sleep never returns early).
    assert 0 < meter.per_second <= 2 * 100 / 0.1
