import logging

import pytest
import torch

from optimum_prune.functional.hessian import cholesky_inverse_upper, damped_cholesky, dead_channels
from optimum_prune.functional.masks import is_valid_nm, num_pruned, unstructured_keep_mask
from optimum_prune.functional.sparsegpt import sparsegpt_prune


def _problem(rows=6, cols=16, tokens=64, seed=0, dead=()):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=gen, dtype=torch.float64) / cols**0.5 + torch.eye(
        cols, dtype=torch.float64
    )
    X = mix @ torch.randn(cols, tokens, generator=gen, dtype=torch.float64)  # correlated inputs, (in, tokens)
    X[list(dead)] = 0.0
    W = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    return W, X, 2.0 * X @ X.T / tokens


def _damped(H, percdamp):
    H = H.clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    return H + percdamp * torch.diagonal(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)


def naive_obs(W, H, percdamp=0.01, sparsity=None, nm=None, mask=None):
    """Brute-force OBS sweep: for column j, re-inverts H restricted to the remaining columns j..n-1."""
    W = W.double().clone()
    W[:, torch.diagonal(H) == 0] = 0.0
    Hd = _damped(H.double(), percdamp)
    rows, cols = W.shape
    inv_d = torch.stack([torch.linalg.inv(Hd[j:, j:])[0, 0] for j in range(cols)])  # [H_F⁻¹]_00 per column
    keep = torch.ones(rows, cols, dtype=torch.bool) if mask is None else mask.clone()
    if mask is None and nm is None:  # one block covering all columns: select on the initial saliency
        order = torch.argsort((W**2 / inv_d).flatten())
        keep.view(-1)[order[: num_pruned(W.numel(), sparsity)]] = False
    for j in range(cols):
        Hinv_F = torch.linalg.inv(Hd[j:, j:])
        if mask is None and nm is not None and j % nm[1] == 0:
            sal = W[:, j : j + nm[1]] ** 2 / inv_d[j : j + nm[1]]
            keep[:, j : j + nm[1]] = False
            for r in range(rows):
                keep[r, j + torch.argsort(sal[r], descending=True)[: nm[0]]] = True
        for r in range(rows):
            if not keep[r, j]:
                W[r, j:] -= W[r, j] / Hinv_F[0, 0] * Hinv_F[0, :]
                W[r, j] = 0.0
    return W, keep


def test_damped_cholesky_and_inverse_factor():
    _, _, H = _problem(seed=1)
    H_before = H.clone()
    L = damped_cholesky(H, percdamp=0.05)
    assert L.dtype == torch.float64 and torch.equal(H, H_before)
    torch.testing.assert_close(L @ L.T, _damped(H, 0.05))
    U = cholesky_inverse_upper(H, percdamp=0.05)
    assert torch.equal(U, torch.triu(U))
    torch.testing.assert_close(U.T @ U, torch.linalg.inv(_damped(H, 0.05)))
    assert cholesky_inverse_upper(H.float()).dtype == torch.float32
    # worked in the factor's own memory, yet bit for bit the three out-of-place steps (what the solver always did)
    for Hx in (H, H.float()):
        Hd = _damped(Hx, 0.05).to(Hx.dtype)
        want = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True)
        assert torch.equal(cholesky_inverse_upper(Hx, percdamp=0.05), want)


def test_dead_channels_handled_like_sparsegpt():
    _, _, H = _problem(cols=8, dead=(2, 5))
    assert dead_channels(H).nonzero().flatten().tolist() == [2, 5]
    L = damped_cholesky(H)
    torch.testing.assert_close(L @ L.T, _damped(H, 0.01))
    assert (L @ L.T)[2, 2] > 1.0  # 1 + damping


def test_cholesky_retries_with_more_damping(caplog):
    H = torch.diag(torch.tensor([1.0, 1.0, 1.0, -0.05], dtype=torch.float64))  # fails at 0.01, passes at 0.1
    with caplog.at_level(logging.WARNING):
        L = damped_cholesky(H, percdamp=0.01)
    torch.testing.assert_close(L @ L.T, _damped(H, 0.1))
    assert "retrying" in caplog.text
    with pytest.raises(torch.linalg.LinAlgError, match="failed"):
        damped_cholesky(torch.diag(torch.tensor([1.0, -100.0])), retries=1)
    with pytest.raises(ValueError, match="NaN"):
        damped_cholesky(torch.full((2, 2), float("nan")))


@pytest.mark.parametrize("blocksize", [3, 5, 128])
def test_fixed_mask_matches_naive_obs_for_any_blocksize(blocksize):
    W, _, H = _problem(seed=2)
    mask = torch.rand(W.shape, generator=torch.Generator().manual_seed(3)) > 0.5
    new_W, info = sparsegpt_prune(W, H, mask=mask, blocksize=blocksize)
    ref_W, _ = naive_obs(W, H, mask=mask)
    torch.testing.assert_close(new_W, ref_W, rtol=1e-9, atol=1e-9)
    assert torch.equal(info["keep_mask"], mask) and (new_W[~mask] == 0).all()


def test_unstructured_matches_naive_obs():
    W, _, H = _problem(seed=4)
    new_W, info = sparsegpt_prune(W, H, sparsity=0.5, blocksize=128)
    ref_W, ref_keep = naive_obs(W, H, sparsity=0.5)
    assert torch.equal(info["keep_mask"], ref_keep)
    torch.testing.assert_close(new_W, ref_W, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("blocksize", [6, 8, 128])  # 6 is rounded down to 4
def test_nm_matches_naive_obs(blocksize):
    W, _, H = _problem(seed=5)
    new_W, info = sparsegpt_prune(W, H, pattern="2:4", blocksize=blocksize)
    ref_W, ref_keep = naive_obs(W, H, nm=(2, 4))
    assert torch.equal(info["keep_mask"], ref_keep)
    torch.testing.assert_close(new_W, ref_W, rtol=1e-9, atol=1e-9)
    assert is_valid_nm(new_W, 2, 4) and int((new_W == 0).sum()) == W.numel() // 2


def test_dead_channels_match_naive_obs():
    W, _, H = _problem(seed=6, dead=(1, 7))
    new_W, info = sparsegpt_prune(W, H, sparsity=0.25, blocksize=128)
    ref_W, _ = naive_obs(W, H, sparsity=0.25)
    torch.testing.assert_close(new_W, ref_W, rtol=1e-9, atol=1e-9)
    assert info["dead_channels"] == 2 and (new_W[:, [1, 7]] == 0).all()


def test_exact_sparsity_with_uneven_blocks():
    W, _, H = _problem(rows=16, cols=40, seed=7)
    new_W, info = sparsegpt_prune(W.float(), H.float(), sparsity=0.37, blocksize=16)  # blocks 16, 16, 8
    assert int((new_W == 0).sum()) == num_pruned(W.numel(), 0.37)
    assert torch.equal(new_W == 0, ~info["keep_mask"]) and new_W.dtype == torch.float32


def test_reduces_error_vs_magnitude_and_float32_agrees():
    gen = torch.Generator().manual_seed(8)
    low_rank = torch.randn(64, 16, generator=gen, dtype=torch.float64) @ torch.randn(16, 256, generator=gen).double()
    X = low_rank + 0.3 * torch.randn(64, 256, generator=gen, dtype=torch.float64)  # strongly correlated inputs
    W, H = torch.randn(32, 64, generator=gen, dtype=torch.float64), 2.0 * X @ X.T / 256
    mag_mask = unstructured_keep_mask(W.abs(), 0.5)
    err_mag = torch.linalg.norm((W * mag_mask - W) @ X)
    W_recon, _ = sparsegpt_prune(W, H, mask=mag_mask)
    W_sgpt, _ = sparsegpt_prune(W, H, sparsity=0.5, blocksize=16)
    assert torch.linalg.norm((W_recon - W) @ X) < 0.85 * err_mag  # same mask, OBS compensation
    assert torch.linalg.norm((W_sgpt - W) @ X) < 0.7 * err_mag  # mask chosen with the Hessian too
    W_32, _ = sparsegpt_prune(W.float(), H.float(), sparsity=0.5, blocksize=16)
    torch.testing.assert_close(W_32.double(), W_sgpt, rtol=1e-3, atol=1e-3)


def test_dtype_roundtrip_and_errors():
    W, _, H = _problem(cols=8)
    out, _ = sparsegpt_prune(W.to(torch.bfloat16), H.float(), sparsity=0.5)
    assert out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="in_features=6"):
        sparsegpt_prune(torch.randn(4, 6), torch.eye(6), pattern="2:4")
    with pytest.raises(ValueError, match="smaller than M"):
        sparsegpt_prune(W, H, pattern="4:4")
    with pytest.raises(ValueError, match="needs `sparsity`"):
        sparsegpt_prune(W, H)
    with pytest.raises(ValueError, match="H must have shape"):
        sparsegpt_prune(W, torch.eye(5), sparsity=0.5)
