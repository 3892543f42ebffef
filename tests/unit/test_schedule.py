import numpy as np
import pytest

from esbatch.train.schedule import batch_indices, consumed, schedule_start, updates_per_epoch


def test_keep_tail_batches_cover_each_epoch_exactly_once():
    n, b = 10, 4
    assert updates_per_epoch(n, b) == 3
    for epoch in range(3):
        seen = []
        for k in range(3):
            e, idx = batch_indices(0, epoch * 3 + k, n, b)
            assert e == epoch
            seen += idx
        assert sorted(seen) == list(range(10))  # the tail batch (2 items) is kept, nothing dropped
    assert len(batch_indices(0, 2, n, b)[1]) == 2


def test_reshuffled_each_epoch_and_reproducible():
    first = [batch_indices(0, k, 100, 10)[1] for k in range(10)]
    second = [batch_indices(0, 10 + k, 100, 10)[1] for k in range(10)]
    assert first != second
    assert first == [batch_indices(0, k, 100, 10)[1] for k in range(10)]
    assert first != [batch_indices(1, k, 100, 10)[1] for k in range(10)]


def test_a_start_of_zero_is_the_plain_schedule():
    for t in range(40):
        assert batch_indices(5, t, 13, 4, start=0) == batch_indices(5, t, 13, 4)
    assert consumed(0, 13, 4) == 0 and consumed(4, 13, 4) == 13 and consumed(5, 13, 4) == 17


@pytest.mark.parametrize("n,b,u1,u2", [(20, 4, 3, 9), (13, 4, 2, 10), (13, 4, 4, 4), (7, 3, 5, 6)])
def test_two_stages_with_one_batch_size_see_exactly_the_single_runs_batches(n, b, u1, u2):
    """ES->GRPO over u1 + u2 updates sees the examples one run of u1 + u2 updates sees, in the same order."""
    single = [batch_indices(11, t, n, b) for t in range(u1 + u2)]
    start = schedule_start(n, [[u1, b]])
    piped = [batch_indices(11, t, n, b) for t in range(u1)] + [batch_indices(11, t, n, b, start) for t in range(u2)]
    assert piped == single


def test_a_second_stage_with_another_batch_size_continues_the_stream():
    """Stage 1 (B=4, 2 updates) takes positions 0-7 of epoch 0; stage 2 (B=3) goes on at 8: 8-10, 11-12 (the
    tail), then epoch 1 from its start. Nothing is seen twice before every example was seen once."""
    n, seed = 13, 2
    order0 = np.random.default_rng([seed, 0, 0xDA7A]).permutation(n).tolist()
    order1 = np.random.default_rng([seed, 1, 0xDA7A]).permutation(n).tolist()
    start = schedule_start(n, [[2, 4]])
    assert start == 8
    assert batch_indices(seed, 0, n, 3, start) == (0, order0[8:11])
    assert batch_indices(seed, 1, n, 3, start) == (0, order0[11:13])
    assert batch_indices(seed, 2, n, 3, start) == (1, order1[0:3])
    assert schedule_start(n, [[2, 4], [2, 3]]) == 13
    assert schedule_start(n, [[2, 4], [3, 3]]) == 16
