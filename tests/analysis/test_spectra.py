"""Tests for vitlab.analysis.spectra: low-rank spectra against dense C x C decompositions and identities."""

import pytest
import torch

from vitlab.analysis.spectra import effective_rank, qk_matrices, qk_spectra


def _weights(width, heads, hd, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(heads * hd, 1, generator=g, dtype=dtype) + 0.5  # uneven row norms
    wq = torch.randn(heads * hd, width, generator=g, dtype=dtype) * scale
    wk = torch.randn(heads * hd, width, generator=g, dtype=dtype) / scale.flip(0)
    return wq, wk


def _dense(m):
    """Dense reference spectra of one C x C matrix M."""
    sym, asym = (m + m.T) / 2, (m - m.T) / 2
    sym_eig = torch.linalg.eigvalsh(sym)
    asym_imag = torch.linalg.eigvals(asym).imag
    return sym, asym, sym_eig, asym_imag, torch.linalg.svdvals(m)


def _close(got, expected, rel=1e-5):
    """Relative agreement, measured against the largest magnitude (the values' own scale)."""
    scale = expected.abs().max()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert (got - expected).abs().max() <= rel * scale, ((got - expected).abs().max() / scale).item()


@pytest.mark.parametrize("width,heads,hd", [(48, 4, 12), (40, 2, 8), (16, 1, 16)])
def test_per_head_spectra_equal_dense(width, heads, hd):
    wq, wk = _weights(width, heads, hd, seed=width + heads)
    spec = qk_spectra(wq, wk, heads)
    k = min(width, 2 * hd)
    assert spec.sym_eigvals.shape == (heads, k) and spec.asym_imag.shape == (heads, k // 2)
    assert spec.singular_values.shape == (heads, min(hd, width)) and spec.num_heads == heads
    for h in range(heads):
        m = wq[h * hd : (h + 1) * hd].T @ wk[h * hd : (h + 1) * hd]  # (C, C)
        sym, asym, sym_eig, asym_imag, sv = _dense(m)
        nonzero = sym_eig[sym_eig.abs().argsort(descending=True)[:k]].sort(descending=True).values
        _close(spec.sym_eigvals[h], nonzero)
        _close(spec.asym_imag[h], asym_imag.sort(descending=True).values[: k // 2])
        _close(spec.singular_values[h], sv[: min(hd, width)])
        # The discarded part of the dense spectra is zero: rank S <= 2hd, rank M <= hd.
        discarded = sym_eig.abs().sort().values[: width - k]
        assert discarded.numel() == 0 or discarded.max() < 1e-10 * sym_eig.abs().max()
        rho = nonzero.clamp_min(0).sum() / nonzero.abs().sum()
        score = (sym.square().sum() - asym.square().sum()) / m.square().sum()
        p = sv / sv.sum()
        erank = torch.exp(-(p[p > 0] * p[p > 0].log()).sum())
        torch.testing.assert_close(spec.positive_mass[h], rho, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(spec.symmetry_score[h], score, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(spec.effective_rank[h], erank, rtol=1e-6, atol=1e-8)


def test_head_summed_spectra_equal_dense():
    wq, wk = _weights(32, 4, 8, seed=7)
    spec = qk_spectra(wq, wk, 4)
    summed = spec.summed
    assert summed is not None and summed.num_heads == 1 and summed.summed is None
    _, _, sym_eig, asym_imag, sv = _dense(wq.T @ wk)
    _close(summed.sym_eigvals[0], sym_eig.flip(0))
    _close(summed.asym_imag[0], asym_imag.sort(descending=True).values[:16])
    _close(summed.singular_values[0], sv)
    assert qk_spectra(wq, wk, 4, summed=False).summed is None


def test_spectral_identities():
    width, heads, hd = 40, 4, 6
    wq, wk = _weights(width, heads, hd, seed=11)
    spec = qk_spectra(wq, wk, heads)
    mats = qk_matrices(wq, wk, heads)  # (H, C, C)
    for h in range(heads):
        wq_h, wk_h = wq[h * hd : (h + 1) * hd], wk[h * hd : (h + 1) * hd]
        torch.testing.assert_close(mats[h], wq_h.T @ wk_h, rtol=1e-12, atol=1e-12)
    # |M|^2 = |S|^2 + |A|^2, from the three spectra this module returns.
    m_sq = spec.singular_values.square().sum(1)
    s_sq, a_sq = spec.sym_eigvals.square().sum(1), 2 * spec.asym_imag.square().sum(1)
    torch.testing.assert_close(m_sq, s_sq + a_sq, rtol=1e-8, atol=0)
    torch.testing.assert_close(m_sq, mats.square().sum((1, 2)), rtol=1e-8, atol=0)
    # tr M = tr S = sum of the nonzero eigenvalues of M, which are those of Wk_h Wq_h^T (hd x hd).
    for h in range(heads):
        small = wk[h * hd : (h + 1) * hd] @ wq[h * hd : (h + 1) * hd].T  # (hd, hd)
        eig_small = torch.linalg.eigvals(small)
        eig_dense = torch.linalg.eigvals(mats[h])
        eig_dense = eig_dense[eig_dense.abs().argsort(descending=True)[:hd]]
        key = lambda z: (z.real * 1e6).round() + z.imag  # noqa: E731 - sort complex values stably
        eig_small, eig_dense = eig_small[key(eig_small).argsort()], eig_dense[key(eig_dense).argsort()]
        torch.testing.assert_close(eig_small, eig_dense, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(spec.sym_eigvals[h].sum(), eig_small.real.sum(), rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(spec.sym_eigvals[h].sum(), torch.trace(mats[h]), rtol=1e-8, atol=1e-10)
    # x^T A x = 0 for the antisymmetric part.
    x = torch.randn(heads, width, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    asym = (mats - mats.mT) / 2
    quad = (x * (asym @ x)).sum(1)  # (H, 5)
    assert quad.abs().max() < 1e-12 * asym.abs().max() * x.square().sum(1).max()


def test_random_heads_are_balanced_and_symmetric_heads_are_not():
    wq, wk = _weights(64, 8, 8, seed=5)
    spec = qk_spectra(wq, wk, 8)
    assert 0.4 < spec.positive_mass.mean() < 0.6
    assert spec.symmetry_score.abs().mean() < 0.3
    sym = qk_spectra(wq, wq.clone(), 8, summed=False)  # Wq = Wk: M = Wq_h^T Wq_h, positive semidefinite
    torch.testing.assert_close(sym.positive_mass, torch.ones(8, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(sym.symmetry_score, torch.ones(8, dtype=torch.float64), rtol=0, atol=1e-10)
    assert sym.asym_imag.max() < 1e-6 * sym.sym_eigvals.max()
    neg = qk_spectra(wq, -wq, 8, summed=False)  # negative semidefinite
    torch.testing.assert_close(neg.positive_mass, torch.zeros(8, dtype=torch.float64), rtol=0, atol=1e-12)
    # Wq_h rows (a, b), Wk_h rows (b, -a): M = a b^T - b a^T is antisymmetric.
    a, b = wq[:2]
    anti = qk_spectra(torch.stack([a, b]), torch.stack([b, -a]), 1, summed=False)
    torch.testing.assert_close(anti.symmetry_score, -torch.ones(1, dtype=torch.float64), rtol=0, atol=1e-10)


def test_float32_input_is_computed_in_float64():
    wq, wk = _weights(48, 4, 12, seed=9, dtype=torch.float32)
    got = qk_spectra(wq, wk, 4)
    ref = qk_spectra(wq.double(), wk.double(), 4)
    assert got.sym_eigvals.dtype == torch.float64
    torch.testing.assert_close(got.sym_eigvals, ref.sym_eigvals, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.summed.singular_values, ref.summed.singular_values, rtol=1e-12, atol=1e-12)


def test_effective_rank():
    sv = torch.tensor([[3.0, 3.0, 3.0, 0.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(effective_rank(sv), torch.tensor([3.0, 1.0, 0.0], dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(effective_rank(x * 17.0), effective_rank(x))
    assert torch.all((effective_rank(x) >= 1) & (effective_rank(x) <= 7))
    with pytest.raises(ValueError, match=">= 0"):
        effective_rank(torch.tensor([1.0, -1.0]))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"\(8, 16\).*\(8, 12\)"):
        qk_spectra(torch.zeros(8, 16), torch.zeros(8, 12), 2)
    with pytest.raises(ValueError, match="num_heads=3"):
        qk_spectra(torch.zeros(8, 16), torch.zeros(8, 16), 3)


def test_block_spectra_solve_blocks_of_one_shape_together_as_each_alone():
    """A Swin-like state with two block shapes: the batched spectra equal :func:`qk_spectra` of each block alone."""
    from vitlab.analysis.spectra import block_spectra

    gen = torch.Generator().manual_seed(3)
    state, heads = {}, {}
    for name, num_heads, width in (("stage0.block0", 2, 16), ("stage0.block1", 2, 16), ("stage1.block0", 4, 32)):
        heads[name] = num_heads
        for m in "qk":
            state[f"{name}.{m}.weight"] = torch.randn(width, width, generator=gen)
    batched = block_spectra(state, heads, out_device="cpu")
    assert list(batched) == list(heads)
    for name, num_heads in heads.items():
        alone = qk_spectra(state[f"{name}.q.weight"], state[f"{name}.k.weight"], num_heads)
        for field in ("sym_eigvals", "asym_imag", "singular_values", "positive_mass", "symmetry_score", "effective_rank"):
            torch.testing.assert_close(getattr(batched[name], field), getattr(alone, field), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(getattr(batched[name].summed, field), getattr(alone.summed, field), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("summed_width,heads,hd", [(48, 4, 12), (24, 2, 16)])
def test_without_the_antisymmetric_eigenvalues_every_other_field_is_the_same(summed_width, heads, hd):
    """``antisymmetric=False`` skips A's eigenproblems only: the other fields are the same tensors, bit for bit, and
    the symmetry score (from the matrix, tr(M^2) / |M|_F^2) agrees with the one its eigenvalues give."""
    from vitlab.analysis.spectra import block_spectra

    gen = torch.Generator().manual_seed(summed_width + hd)
    state, names = {}, ("blocks.0", "blocks.1")
    for name in names:
        for m in "qk":
            state[f"{name}.{m}.weight"] = torch.randn(heads * hd, summed_width, generator=gen)
    both = block_spectra(state, dict.fromkeys(names, heads), out_device="cpu")
    lean = block_spectra(state, dict.fromkeys(names, heads), out_device="cpu", antisymmetric=False)
    single = qk_spectra(state["blocks.1.q.weight"], state["blocks.1.k.weight"], heads, antisymmetric=False)
    for name in names:
        for full, part in ((both[name], lean[name]), (both[name].summed, lean[name].summed)):
            assert part.asym_imag is None and full.asym_imag is not None
            for field in ("sym_eigvals", "singular_values", "positive_mass", "symmetry_score", "effective_rank"):
                assert torch.equal(getattr(full, field), getattr(part, field)), (name, field)
            # |S|^2 - |A|^2 over |M|^2, with |A|^2 from A's eigenvalues (each +-i lambda pair twice)
            s_sq, a_sq = full.sym_eigvals.square().sum(1), 2 * full.asym_imag.square().sum(1)
            torch.testing.assert_close(full.symmetry_score, (s_sq - a_sq) / (s_sq + a_sq), rtol=1e-10, atol=1e-12)
    for field in ("sym_eigvals", "singular_values", "symmetry_score", "positive_mass", "effective_rank"):
        torch.testing.assert_close(getattr(single, field), getattr(lean["blocks.1"], field), rtol=1e-12, atol=1e-12)
    assert single.asym_imag is None and single.summed.asym_imag is None
