"""The pieces of `tessera plan --measure` that need no ranks: Spearman's rank correlation
(checked against scipy), and the synthetic corpus the candidates train on."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.plan.measure import cpu_share, cpu_step_time, ranks, spearman, synthetic_data
from tessera.training.indexed_dataset import IndexedDataset


@pytest.mark.parametrize("xs, ys", [
    ([0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 3.0, 4.0]),
    ([0.1, 0.2, 0.3, 0.4], [4.0, 3.0, 2.0, 1.0]),
    ([0.1, 0.2, 0.2, 0.5, 0.7], [0.3, 0.1, 0.9, 0.9, 2.0]),  # ties on both sides
    ([3.0, 1.0, 2.0], [30.0, 20.0, 10.0]),
])
def test_spearman_matches_scipy(xs, ys):
    stats = pytest.importorskip("scipy.stats")
    assert spearman(xs, ys) == pytest.approx(stats.spearmanr(xs, ys).statistic, abs=1e-12)


def test_spearman_edge_cases():
    assert ranks([5.0, 1.0, 5.0, 3.0]) == [3.5, 1.0, 3.5, 2.0]
    assert spearman([1.0], [2.0]) is None
    assert spearman([1.0, 1.0], [1.0, 2.0]) is None  # no ranking to correlate
    with pytest.raises(ValueError, match="equally long"):
        spearman([1.0, 2.0], [1.0])


def test_synthetic_data_has_the_vocabulary_and_size_asked(tmp_path):
    prefix = synthetic_data(tmp_path, vocab_size=300, tokens=10_000)
    ds = IndexedDataset(prefix)
    tokens = np.concatenate([ds[i] for i in range(len(ds))])
    assert ds.vocab_size == 300 and 10_000 <= tokens.size <= 10_000 + 512
    assert tokens.min() >= 0 and tokens.max() < 300


def test_cpu_share_is_cpu_over_wall_time_of_the_timed_steps():
    # Two ranks, three steps, the first (warm-up) left out. Rank 0 ran 1.0 of 2.0 s, rank 1
    # 0.5 of 2.0 s: a quarter and a half of a core on average -> (0.5 + 0.25) / 2.
    reports = [([9.0, 1.0, 1.0], [9.0, 0.5, 0.5], None, None),
               ([9.0, 1.0, 1.0], [0.0, 0.25, 0.25], None, None)]
    assert cpu_share(reports, warmup=1) == pytest.approx(0.375)
    assert cpu_share(reports, warmup=5) == pytest.approx((0.5 + 0.25) / 2)  # the last step
    assert cpu_share([([], [], None, "failed")], warmup=1) is None


def test_cpu_step_time_is_the_busiest_ranks_median_cpu_per_timed_step():
    # Rank 0's timed steps took 0.5, 0.7, 0.6 s of CPU (median 0.6), rank 1's 0.2, 0.9, 0.3
    # (median 0.3): the busiest rank's 0.6. The warm-up step (9.0) is left out.
    reports = [([9.0, 1.0, 1.0, 1.0], [9.0, 0.5, 0.7, 0.6], None, None),
               ([9.0, 1.0, 1.0, 1.0], [9.0, 0.2, 0.9, 0.3], None, None)]
    assert cpu_step_time(reports, warmup=1) == pytest.approx(0.6)
    assert cpu_step_time(reports, warmup=9) == pytest.approx(0.6)  # the last step only
    assert cpu_step_time([([], [], None, "failed")], warmup=1) is None
