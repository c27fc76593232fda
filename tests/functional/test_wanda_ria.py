import pytest
import torch

from optimum_prune.functional.masks import is_valid_nm, keep_mask, nm_keep_mask
from optimum_prune.functional.scores import ria_scores, wanda_scores
from optimum_prune.methods.ria.functional import nm_retained_score, ria_channel_reallocation


def _weight_and_inputs(rows=6, cols=16, tokens=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=gen)
    X = torch.randn(tokens, cols, generator=gen) * torch.linspace(0.1, 3.0, cols)  # (tokens, in), uneven norms
    return W, X


def test_wanda_with_unit_norms_is_per_row_magnitude():
    W, _ = _weight_and_inputs()
    scores = wanda_scores(W, sumsq=torch.full((16,), 7.0), nsamples=7)
    torch.testing.assert_close(scores, W.abs())
    assert torch.equal(keep_mask(scores, 0.5, per="row"), keep_mask(W.abs(), 0.5, per="row"))
    assert torch.equal(keep_mask(scores, pattern="2:4"), nm_keep_mask(W.abs(), 2, 4))


def test_wanda_scores_match_explicit_input_norms():
    W, X = _weight_and_inputs(seed=1)
    scores = wanda_scores(W, (X**2).sum(dim=0))
    expected = torch.empty_like(W)
    for i in range(W.shape[0]):
        for j in range(W.shape[1]):
            expected[i, j] = W[i, j].abs() * torch.linalg.norm(X[:, j])
    torch.testing.assert_close(scores, expected)
    # the normaliser scales all scores alike and leaves the mask unchanged
    torch.testing.assert_close(wanda_scores(W, (X**2).sum(dim=0), nsamples=4), expected / 2)
    assert not torch.equal(keep_mask(scores, 0.5, per="row"), keep_mask(W.abs(), 0.5, per="row"))


def test_wanda_validation():
    W, _ = _weight_and_inputs()
    with pytest.raises(ValueError, match="sumsq must have shape"):
        wanda_scores(W, torch.ones(15))
    with pytest.raises(ValueError, match="nsamples"):
        wanda_scores(W, torch.ones(16), nsamples=0)
    assert wanda_scores(W.double(), torch.ones(16)).dtype == torch.float64


@pytest.mark.parametrize("a", [0.5, 0.0, 1.0])
def test_ria_scores_match_explicit_loop(a):
    W, X = _weight_and_inputs(seed=2)
    sumsq = (X**2).sum(dim=0)
    scores = ria_scores(W, sumsq, a=a, nsamples=50)
    expected = torch.empty_like(W)
    for i in range(W.shape[0]):
        for j in range(W.shape[1]):
            col = sum(abs(W[k, j]) for k in range(W.shape[0]))
            row = sum(abs(W[i, k]) for k in range(W.shape[1]))
            act = (float(sumsq[j]) / 50) ** 0.5
            expected[i, j] = (abs(W[i, j]) / col + abs(W[i, j]) / row) * act**a
    torch.testing.assert_close(scores, expected)


def test_ria_zero_rows_and_columns_give_zero_scores():
    W, X = _weight_and_inputs(seed=3)
    W[2] = 0.0
    W[:, 5] = 0.0
    scores = ria_scores(W, (X**2).sum(dim=0))
    assert torch.isfinite(scores).all()
    assert (scores[2] == 0).all() and (scores[:, 5] == 0).all() and (scores[0, :5] > 0).all()


def test_channel_reallocation_interleaves_strips():
    # column sums increase with the column index, so the ascending sort is the identity
    scores = torch.arange(1.0, 9.0).repeat(3, 1)  # (3, 8)
    keep, perm = ria_channel_reallocation(scores, 2, 4)
    # strips [0,1] [2,3] [4,5] [6,7]; odd strips reversed; strip s fills slot s of every group
    assert perm.tolist() == [0, 3, 4, 7, 1, 2, 5, 6]
    assert torch.equal(keep[:, perm], nm_keep_mask(scores[:, perm], 2, 4))


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (4, 8)])
def test_channel_reallocation_is_valid_nm_in_permuted_order(n, m):
    W, X = _weight_and_inputs(rows=8, cols=32, seed=4)
    scores = ria_scores(W, (X**2).sum(dim=0))
    keep, perm = ria_channel_reallocation(scores, n, m)
    assert sorted(perm.tolist()) == list(range(32))
    assert is_valid_nm(keep[:, perm].float(), n, m)
    assert int(keep.sum()) == 8 * 32 * n // m
    with pytest.raises(ValueError, match="in_features=30"):
        ria_channel_reallocation(scores[:, :30], n, m)


def test_linear_sum_assignment_never_lowers_retained_score():
    W, X = _weight_and_inputs(rows=8, cols=32, seed=5)
    scores = ria_scores(W, (X**2).sum(dim=0))
    _, perm_h = ria_channel_reallocation(scores, 2, 4)
    keep, perm = ria_channel_reallocation(scores, 2, 4, lsa=True, lsa_chunk=3)
    before = nm_retained_score(scores[:, perm_h], 2, 4)
    after = nm_retained_score(scores[:, perm], 2, 4)
    assert after > before  # each pass is an exact assignment; the identity is one candidate
    assert sorted(perm.tolist()) == list(range(32)) and is_valid_nm(keep[:, perm].float(), 2, 4)
    torch.testing.assert_close(torch.tensor(after), (scores * keep).sum())
    _, perm_b = ria_channel_reallocation(scores, 2, 4, lsa=True, lsa_blocks=2)
    assert nm_retained_score(scores[:, perm_b], 2, 4) >= before - 1e-5
    with pytest.raises(ValueError, match="lsa_blocks"):
        ria_channel_reallocation(scores, 2, 4, lsa=True, lsa_blocks=3)


def test_linear_sum_assignment_without_scipy_names_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scipy" else find_spec(name, *a))
    W, X = _weight_and_inputs(rows=8, cols=32, seed=5)
    scores = ria_scores(W, (X**2).sum(dim=0))
    with pytest.raises(ImportError, match=r"pip install 'optimum-prune\[lsa\]'"):
        ria_channel_reallocation(scores, 2, 4, lsa=True)
    keep, perm = ria_channel_reallocation(scores, 2, 4)  # the heuristic alone needs nothing more
    assert is_valid_nm(keep[:, perm].float(), 2, 4)
