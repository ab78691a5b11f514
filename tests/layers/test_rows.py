"""layers/rows.py: a cache appended without copying, whose older versions stay as they were."""
import torch

from waste.layers.rows import Rows


def test_appends_share_one_buffer_and_older_versions_keep_their_rows():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 3, generator=g) for n in (5, 1, 1, 30, 1)]
    r = Rows(torch.empty(0, 3))
    versions = [r]
    for x in xs:
        versions.append(versions[-1].append(x))
    want = torch.cat(xs)
    for v in versions:
        assert torch.equal(v.data, want[:len(v)])
    # one buffer while it had room: a decode step wrote its row in place (no copy of the earlier rows)
    assert versions[2].data.data_ptr() == versions[3].data.data_ptr()


def test_a_branch_copies_and_leaves_the_other_line_alone():
    base = Rows(torch.zeros(0, 2)).append(torch.ones(4, 2))
    a = base.append(torch.full((1, 2), 2.0))
    b = base.append(torch.full((1, 2), 3.0))          # the same base, appended again
    assert len(base) == 4 and torch.equal(base.data, torch.ones(4, 2))
    assert a.data[-1].tolist() == [2.0, 2.0] and b.data[-1].tolist() == [3.0, 3.0]
    assert torch.equal(a.data[:4], b.data[:4])


def test_a_new_dtype_reallocates():
    r = Rows(torch.zeros(2, 2, dtype=torch.float32)).append(torch.ones(1, 2, dtype=torch.bfloat16))
    assert r.data.dtype == torch.bfloat16 and r.data[:, 0].tolist() == [0.0, 0.0, 1.0]
