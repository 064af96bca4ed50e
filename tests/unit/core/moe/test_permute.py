"""permute / unpermute against a per-token loop written the obvious way."""

import torch

from tessera.core.moe.permute import permute, unpermute


def test_permute_groups_by_expert_and_unpermute_weights_and_sums():
    torch.manual_seed(0)
    n, k, e, h = 7, 2, 4, 3
    x = torch.randn(n, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    ids[3, 1] = -1  # one dropped assignment
    ids[5] = -1  # a token dropped entirely
    w = torch.rand(n, k)
    xs, order, counts = permute(x, ids, e)
    expected_rows = [(t, j) for ex in range(e) for t in range(n) for j in range(k)
                     if ids[t, j] == ex]
    assert counts.tolist() == [sum(1 for t, j in expected_rows if ids[t, j] == ex)
                               for ex in range(e)]
    assert order.tolist() == [t * k + j for t, j in expected_rows]
    assert torch.equal(xs, torch.stack([x[t] for t, _ in expected_rows]))
    f = torch.nn.Linear(h, h)
    ys = f(xs)
    out = unpermute(ys, order, w)
    ref = torch.zeros(n, h)
    for t in range(n):
        for j in range(k):
            if ids[t, j] >= 0:
                ref[t] += w[t, j] * f(x[t])
    torch.testing.assert_close(out, ref)
    assert torch.equal(out[5], torch.zeros(h))
