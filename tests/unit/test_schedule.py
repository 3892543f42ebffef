from esbatch.train.schedule import batch_indices, updates_per_epoch


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
