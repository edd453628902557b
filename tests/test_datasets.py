import numpy as np

from eqxpar import datasets


def test_digits_split_is_deterministic_and_disjoint():
    a, b = datasets.digits(seed=3), datasets.digits(seed=3)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.x_train.shape[1] == 64 and a.num_classes == 10
    assert len(a.x_train) + len(a.x_test) == 1797
    assert a.x_train.dtype == np.float32 and 0 <= a.x_train.min() and a.x_train.max() <= 1
    c = datasets.digits(seed=4)
    assert not np.array_equal(a.y_test, c.y_test)


def test_python_source_text_round_trips():
    text = datasets.python_source_text()
    assert text.vocab_size % 8 == 0
    assert len(text.ids) > 100_000
    assert text.decode(text.encode("def f(x):")) == "def f(x):"
    assert text.decode(text.ids[:200]).count("\n") > 0


def test_text_windows_are_a_pure_function_of_seed_and_step():
    ids = np.arange(1000, dtype=np.int32)
    a = datasets.text_windows(ids, 4, 8, seed=1, step=5)
    np.testing.assert_array_equal(a, datasets.text_windows(ids, 4, 8, seed=1, step=5))
    assert a.shape == (4, 9) and a.dtype == np.int32
    np.testing.assert_array_equal(a[:, 1:] - a[:, :-1], 1)  # contiguous windows of the text
    assert not np.array_equal(a, datasets.text_windows(ids, 4, 8, seed=1, step=6))
    assert not np.array_equal(a, datasets.text_windows(ids, 4, 8, seed=2, step=5))
