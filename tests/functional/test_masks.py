import pytest
import torch

from optimum_prune.functional.masks import (
    check_pattern_fits,
    is_valid_nm,
    keep_mask,
    keep_mask_for_count,
    measured_sparsity,
    nm_keep_mask,
    num_pruned,
    parse_pattern,
    unstructured_keep_mask,
)


def _reference_keep(scores: torch.Tensor, n_prune: int) -> torch.Tensor:
    """Slow reference: prune the n_prune lowest of a 1-D tensor; among ties the higher index is pruned first."""
    vals = scores.tolist()
    order = sorted(range(len(vals)), key=lambda i: (vals[i], -i))
    keep = torch.ones(len(vals), dtype=torch.bool)
    keep[order[:n_prune]] = False
    return keep


def _reference_nm(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    keep = torch.zeros(scores.shape, dtype=torch.bool)
    for r in range(scores.shape[0]):
        for g in range(0, scores.shape[1], m):
            vals = scores[r, g : g + m].tolist()
            best = sorted(range(m), key=lambda i: (-vals[i], i))[:n]  # largest first, lower index on ties
            for i in best:
                keep[r, g + i] = True
    return keep


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("unstructured", None),
        ("UNSTRUCTURED", None),
        (None, None),
        ("2:4", (2, 4)),
        (" 4 : 8 ", (4, 8)),
        ((1, 4), (1, 4)),
    ],
)
def test_parse_pattern_valid(pattern, expected):
    assert parse_pattern(pattern) == expected


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("4:4", "smaller than M"),
        ("5:4", "smaller than M"),
        ("0:4", "at least 1"),
        ("2-4", "Invalid sparsity pattern"),
        ("2:4:8", "Invalid sparsity pattern"),
        ("dense", "Invalid sparsity pattern"),
        ((2.0, 4), "Invalid sparsity pattern"),
        ((3, 2), "smaller than M"),
    ],
)
def test_parse_pattern_errors(pattern, message):
    with pytest.raises(ValueError, match=message):
        parse_pattern(pattern)


def test_check_pattern_fits():
    check_pattern_fits(4096, "2:4")
    check_pattern_fits(4098, "unstructured")
    with pytest.raises(ValueError, match=r"in_features=4098.*4098 % 4 = 2") as exc:
        check_pattern_fits(4098, "2:4", name="model.layers.0.mlp.down_proj")
    assert "down_proj" in str(exc.value)
    with pytest.raises(ValueError, match="in_features=12"):
        check_pattern_fits(12, (4, 8))


def test_num_pruned_rounds_half_up_and_validates():
    assert num_pruned(10, 0.25) == 3  # 2.5 -> 3
    assert num_pruned(7, 0.5) == 4
    assert num_pruned(100, 0.3) == 30
    assert num_pruned(5, 1.0) == 5 and num_pruned(5, 0.0) == 0
    with pytest.raises(ValueError, match="sparsity"):
        num_pruned(10, 1.5)


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("per", ["matrix", "row"])
def test_unstructured_exact_count_and_order(sparsity, per):
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(7, 13, generator=gen)
    keep = unstructured_keep_mask(scores, sparsity, per=per)
    assert keep.dtype == torch.bool and keep.shape == scores.shape
    if per == "matrix":
        assert int((~keep).sum()) == num_pruned(scores.numel(), sparsity)
        groups = [(scores.flatten(), keep.flatten())]
    else:
        assert ((~keep).sum(dim=1) == num_pruned(13, sparsity)).all()
        groups = list(zip(scores, keep))
    for s, k in groups:
        if k.any() and (~k).any():
            assert s[k].min() >= s[~k].max()


@pytest.mark.parametrize("per", ["matrix", "row"])
def test_unstructured_ties_are_deterministic(per):
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 3, (6, 10), generator=gen).float()  # many ties
    for sparsity in (0.2, 0.5, 0.65):
        keep = unstructured_keep_mask(scores, sparsity, per=per)
        if per == "matrix":
            ref = _reference_keep(scores.flatten(), num_pruned(60, sparsity)).reshape(6, 10)
        else:
            ref = torch.stack([_reference_keep(row, num_pruned(10, sparsity)) for row in scores])
        assert torch.equal(keep, ref)
        assert torch.equal(keep, unstructured_keep_mask(scores.clone(), sparsity, per=per))


def test_keep_mask_for_count_and_half_precision():
    scores = torch.tensor([[0.5, 0.1, 0.9, 0.3]], dtype=torch.float16)
    assert keep_mask_for_count(scores, 2).tolist() == [[True, False, True, False]]
    assert keep_mask_for_count(scores, 0).all() and not keep_mask_for_count(scores, 9).any()
    with pytest.raises(ValueError, match="per"):
        keep_mask_for_count(scores, 1, per="column")
    with pytest.raises(ValueError, match="NaN"):
        keep_mask_for_count(torch.tensor([[1.0, float("nan")]]), 1)


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (3, 4), (4, 8)])
def test_nm_keep_mask_matches_reference(n, m):
    gen = torch.Generator().manual_seed(n * 10 + m)
    scores = torch.randint(0, 4, (5, 4 * m), generator=gen).float()  # ties inside groups
    keep = nm_keep_mask(scores, n, m)
    assert torch.equal(keep, _reference_nm(scores, n, m))
    assert (keep.reshape(5, -1, m).sum(-1) == n).all()
    assert is_valid_nm((scores + 1) * keep, n, m) and not is_valid_nm(scores + 1, n, m)


def test_nm_keep_mask_errors():
    with pytest.raises(ValueError, match="in_features=6"):
        nm_keep_mask(torch.rand(3, 6), 2, 4)
    with pytest.raises(ValueError, match="smaller than M"):
        nm_keep_mask(torch.rand(3, 8), 4, 4)


def test_keep_mask_dispatch():
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(4, 8, generator=gen)
    assert torch.equal(keep_mask(scores, pattern="2:4"), nm_keep_mask(scores, 2, 4))
    assert torch.equal(keep_mask(scores, pattern=(1, 4), sparsity=0.9), nm_keep_mask(scores, 1, 4))
    assert torch.equal(keep_mask(scores, 0.5, "unstructured", per="row"), unstructured_keep_mask(scores, 0.5, "row"))
    assert torch.equal(keep_mask(scores, 0.5), unstructured_keep_mask(scores, 0.5, "matrix"))
    with pytest.raises(ValueError, match="sparsity is required"):
        keep_mask(scores)


def test_measured_sparsity_and_is_valid_nm():
    w = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 3.0, -1.0]])
    assert measured_sparsity(w) == pytest.approx(4 / 8)
    assert measured_sparsity(torch.empty(0)) == 0.0
    assert is_valid_nm(w, 2, 4)
    w[0, 1] = 5.0  # first group now has 3 nonzeros
    assert not is_valid_nm(w, 2, 4)
    assert is_valid_nm(w, 3, 4)
    assert not is_valid_nm(torch.zeros(2, 6), 2, 4)  # width not divisible by M
