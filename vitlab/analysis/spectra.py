"""Spectra of the query-key bilinear form (Philip et al., Fig. 5; docs/analyses.md).

Head h of an attention layer scores token pairs with logit_ij = hd^-1/2 x_i^T M_h x_j (+ bias terms), where
M_h = Wq_h^T Wk_h (C x C) and Wq_h, Wk_h (hd x C) are the head's rows of the query / key weights. This is
the poster's W_Q W_K^T (it writes x W, torch writes W x). M_h splits into a symmetric part S = (M + M^T)/2
("similarity") and an antisymmetric part A = (M - M^T)/2.

Everything is computed exactly through the low-rank form: with U = [Wq_h^T, Wk_h^T] (C x 2hd) = Q R,
M_h = Q P Q^T with P = R_q R_k^T (2hd x 2hd), R_q, R_k the first / last hd columns of R. Since Q has
orthonormal columns, S, A and M share their nonzero spectra with (P + P^T)/2, (P - P^T)/2 and P, which are
small. No C x C eigendecomposition is ever done per head.

Cosine attention (Swin V2: logit_ij = exp(min(s_h, log 100)) q_i.k_j / (|q_i| |k_j|) + bias) has no fixed
matrix for its logits; the same M_h is then the bilinear form of the un-normalised numerator q_i.k_j (biases
aside). Its positive mass, symmetry score and effective rank describe the sign and direction structure that
the cosine keeps (a positive per-pair factor does not change signs); its singular values are not logit
magnitudes. vitlab reports these spectra for cosine models, flagged by ``BlockView.attention_form``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["QKSpectra", "qk_spectra", "qk_matrices", "effective_rank"]


@dataclass(frozen=True)
class QKSpectra:
    """Spectral summary of M = Wq^T Wk per head (all float64, sorted descending).

    With k = min(C, 2hd) (the rank bound of S):

    Attributes:
        sym_eigvals: (H, k) eigenvalues of S = (M + M^T)/2 that can be nonzero; S's other C - k are 0.
        asym_imag: (H, k // 2) the lambda >= 0 of A = (M - M^T)/2's eigenvalue pairs +-i*lambda, or None when
            not requested (``antisymmetric=False``: one eigenproblem fewer per matrix).
        singular_values: (H, min(C, hd)) singular values of M (its rank is at most hd).
        positive_mass: (H,) rho+ = sum_{lambda>0} lambda / sum |lambda| over S's spectrum (NaN when S = 0).
        symmetry_score: (H,) (|S|_F^2 - |A|_F^2) / |M|_F^2 = tr(M^2) / |M|_F^2 in [-1, 1]: 1 symmetric,
            -1 antisymmetric (computed from the matrix, so it needs no eigenvalues).
        effective_rank: (H,) Roy & Vetterli's effective rank of M (see :func:`effective_rank`).
        summed: the same fields for the head-summed matrix sum_h M_h = Wq^T Wk (one "head" of width C, so
            H = 1 there and k = C), or None when not requested.
    """

    sym_eigvals: Tensor
    asym_imag: Tensor | None
    singular_values: Tensor
    positive_mass: Tensor
    symmetry_score: Tensor
    effective_rank: Tensor
    summed: QKSpectra | None = None

    @property
    def num_heads(self) -> int:
        """Number of heads H (leading dimension of every field)."""
        return self.sym_eigvals.shape[0]


def effective_rank(singular_values: Tensor) -> Tensor:
    """Effective rank exp(H(p)) of p = sigma / sum(sigma) (Roy & Vetterli 2007).

    It equals r for r equal nonzero singular values and is 1 for a rank-one matrix; a zero matrix gets 0.

    Args:
        singular_values: (..., n) nonnegative singular values.

    Returns:
        (...) effective ranks, in the input's dtype (at least float32).
    """
    if singular_values.ndim == 0:
        raise ValueError("effective_rank: need singular values along the last dimension, got a 0-d tensor")
    sv = singular_values if singular_values.is_floating_point() else singular_values.float()
    if (sv < 0).any():
        raise ValueError("effective_rank: singular values must be >= 0, got negative entries")
    total = sv.sum(-1, keepdim=True)  # (..., 1)
    p = sv / total.clamp_min(torch.finfo(sv.dtype).tiny)  # (..., n)
    entropy = -torch.special.xlogy(p, p).sum(-1)  # 0 log 0 = 0
    return torch.where(total.squeeze(-1) > 0, entropy.exp(), 0.0)


def _split_heads(wq: Tensor, wk: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """Check shapes and return Wq_h, Wk_h as (H, hd, C) views (dtype unchanged)."""
    if wq.ndim != 2 or wq.shape != wk.shape:
        raise ValueError(
            f"qk_spectra: wq and wk must be 2-D (heads*hd, C) weights of equal shape, got {tuple(wq.shape)} "
            f"and {tuple(wk.shape)}"
        )
    rows, width = wq.shape
    if num_heads < 1 or rows % num_heads:
        raise ValueError(f"qk_spectra: num_heads={num_heads} must be >= 1 and divide the {rows} rows of wq")
    shape = (num_heads, rows // num_heads, width)
    if wq.is_complex() or wk.is_complex():
        raise ValueError(f"qk_spectra: need real weights, got dtypes {wq.dtype} and {wk.dtype}")
    return wq.detach().reshape(shape), wk.detach().to(wq.device).reshape(shape)


def _small_form(wq_h: Tensor, wk_h: Tensor) -> tuple[Tensor, Tensor]:
    """M_h in an orthonormal basis of range([Wq_h^T, Wk_h^T]); wq_h, wk_h (H, hd, C), any real dtype.

    Returns (m_core (H, k, k), m_rows): M_h = Q m_core Q^T exactly, k = min(C, 2hd); ``m_rows`` holds the rows
    of m_core that can be nonzero ((H, hd, 2hd) after a QR, m_core itself when no reduction is possible).
    """
    heads, hd, width = wq_h.shape
    if 2 * hd >= width:  # e.g. the head-summed matrix: U cannot be reduced, M itself is the small matrix
        m_core = wq_h.to(torch.float64).mT @ wk_h.to(torch.float64)  # (H, C, C)
        return m_core, m_core
    u_t = torch.empty(heads, 2 * hd, width, dtype=torch.float64, device=wq_h.device)  # (H, 2hd, C) = U^T
    u_t[:, :hd].copy_(wq_h)  # float64 conversion straight into place (u_t.mT is U, column-major)
    u_t[:, hd:].copy_(wk_h)
    u = u_t.mT  # (H, C, 2hd)
    if u.device.type == "cpu":  # factor in place: saves a copy as large as U (measurably faster on CPU)
        u = torch.geqrf(u, out=(u, torch.empty(heads, 2 * hd, dtype=torch.float64)))[0]
    else:
        u = torch.geqrf(u)[0]
    r = u[..., : 2 * hd, :].triu()  # (H, 2hd, 2hd) R of U = QR (Householder); Q is never formed
    r_q, r_k = r[..., :hd], r[..., hd:]  # (H, 2hd, hd) each; r_q's last hd rows are exactly 0
    m_core = r_q @ r_k.mT  # (H, 2hd, 2hd)
    return m_core, m_core[..., :hd, :]


def _spectra(wq_h: Tensor, wk_h: Tensor, antisymmetric: bool = True) -> QKSpectra:
    """Spectra of M_h = wq_h^T wk_h for a batch of heads; wq_h, wk_h (H, hd, C), any real dtype. ``antisymmetric``:
    also A's eigenvalues (else ``asym_imag`` is None; every other field is the same)."""
    hd, width = wq_h.shape[1:]
    m_core, m_rows = _small_form(wq_h, wk_h)
    k = m_core.shape[-1]
    sym = 0.5 * (m_core + m_core.mT)  # (H, k, k) S in the basis
    sym_eigvals = torch.linalg.eigvalsh(sym).flip(-1)  # (H, k) descending
    asym_imag = None
    if antisymmetric:
        asym = 0.5 * (m_core - m_core.mT)  # (H, k, k) A in the basis
        # A is normal with eigenvalues +-i*lambda, so A^T A = -A^2 has each lambda^2 twice
        lambda_sq = torch.linalg.eigvalsh(asym.mT @ asym).flip(-1)[..., : 2 * (k // 2)]  # (H, 2*(k//2)) in pairs
        asym_imag = lambda_sq.reshape(*lambda_sq.shape[:-1], k // 2, 2).mean(-1).clamp_min(0.0).sqrt()  # (H, k//2)
    # M M^T has the sigma^2. Squaring (here and for A above) puts the noise floor at ~1e-8 of the largest value:
    # below the rounding of float32 weights (6e-8 relative), which bounds what these spectra can mean anyway.
    short_side = m_rows @ m_rows.mT if m_rows.shape[-2] <= m_rows.shape[-1] else m_rows.mT @ m_rows
    singular_values = torch.linalg.eigvalsh(short_side).flip(-1)[..., : min(hd, width)].clamp_min(0.0).sqrt()

    positive_mass = sym_eigvals.clamp_min(0.0).sum(-1) / sym_eigvals.abs().sum(-1)  # (H,); 0/0 -> NaN for S = 0
    # |S|_F^2 - |A|_F^2 = sum_ij M_ij M_ji = tr(M^2), |M|_F^2 = sum_ij M_ij^2: the same in the orthonormal basis
    # (M = Q m_core Q^T), and from the matrix itself, whether or not A's eigenvalues are computed
    symmetry_score = (m_core * m_core.mT).sum((-2, -1)) / m_core.square().sum((-2, -1))  # (H,); NaN for M = 0
    return QKSpectra(
        sym_eigvals=sym_eigvals,
        asym_imag=asym_imag,
        singular_values=singular_values,
        positive_mass=positive_mass,
        symmetry_score=symmetry_score,
        effective_rank=effective_rank(singular_values),
    )


def qk_spectra(wq: Tensor, wk: Tensor, num_heads: int, summed: bool = True, antisymmetric: bool = True) -> QKSpectra:
    """Spectra of the per-head query-key matrices M_h = Wq_h^T Wk_h and of their sum.

    Per head this is exact and cheap (QR of the C x 2hd factor, then 2hd x 2hd problems, batched over heads,
    float64). The head-summed matrix sum_h M_h = Wq^T Wk has rank up to C, so there the factor [Wq^T, Wk^T]
    (C x 2C) cannot be reduced and the same formulas run on the dense C x C matrix (still exact; this is
    one dense problem per layer, and the most expensive part: pass ``summed=False`` to skip it).

    Args:
        wq: (H*hd, C) query weight (nn.Linear layout (out, in)); head h = rows h*hd:(h+1)*hd.
        wk: (H*hd, C) key weight, same layout.
        num_heads: H.
        summed: also compute the head-summed spectra (``result.summed``).
        antisymmetric: also the eigenvalues of the antisymmetric parts (``asym_imag``; a quarter of the time of
            the head-summed spectra); the other fields are the same without them.

    Returns:
        :class:`QKSpectra` with per-head fields (H, ...) and ``summed`` (H = 1) or None.
    """
    wq_h, wk_h = _split_heads(wq, wk, num_heads)  # (H, hd, C) each
    per_head = _spectra(wq_h, wk_h, antisymmetric)
    if not summed:
        return per_head
    total = _spectra(wq.detach().unsqueeze(0), wk.detach().to(wq.device).unsqueeze(0), antisymmetric)  # one head of width C
    return QKSpectra(**{**per_head.__dict__, "summed": total})


def qk_matrices(wq: Tensor, wk: Tensor, num_heads: int) -> Tensor:
    """Dense per-head bilinear forms M_h = Wq_h^T Wk_h, e.g. to plot them (not needed for spectra).

    Args:
        wq: (H*hd, C) query weight.
        wk: (H*hd, C) key weight.
        num_heads: H.

    Returns:
        (H, C, C) float64; x_i^T M_h x_j is head h's logit before the hd^-1/2 scale and biases.
    """
    wq_h, wk_h = _split_heads(wq, wk, num_heads)  # (H, hd, C)
    return wq_h.to(torch.float64).mT @ wk_h.to(torch.float64)  # (H, C, C)


_FIELDS = ("sym_eigvals", "asym_imag", "singular_values", "positive_mass", "symmetry_score", "effective_rank")


def _each_field(spectra: QKSpectra, fn) -> QKSpectra:
    """``fn`` applied to every field computed (``asym_imag`` may be None); without ``summed``."""
    return QKSpectra(**{name: None if getattr(spectra, name) is None else fn(getattr(spectra, name)) for name in _FIELDS})


def _concat(parts: list[QKSpectra]) -> QKSpectra:
    """The fields of ``parts`` (chunks of one batch, in order) joined along the batch."""
    return QKSpectra(**{name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
                        for name in _FIELDS})


def _solve(wq_h: Tensor, wk_h: Tensor, antisymmetric: bool, executor) -> Callable[[], QKSpectra]:
    """``_spectra`` of a batch, started now: in chunks on ``executor``'s threads (host tensors only), else when the
    returned function is called."""
    if executor is None or wq_h.device.type != "cpu" or len(wq_h) < 2:
        return lambda: _spectra(wq_h, wk_h, antisymmetric)
    bounds = torch.linspace(0, len(wq_h), min(len(wq_h), executor.threads) + 1).round().long().tolist()
    futures = [executor.submit(_spectra, wq_h[a:b], wk_h[a:b], antisymmetric) for a, b in zip(bounds, bounds[1:])]
    return lambda: _concat([f.result() for f in futures])


def block_spectra(state: dict[str, Tensor], heads: dict[str, int], summed: bool = True,
                  out_device: str | torch.device | None = None, antisymmetric: bool = True,
                  executor=None) -> dict[str, QKSpectra]:
    """``qk_spectra`` of every block of a flat Q/K/V state (see :func:`vitlab.qkv.state.qkv_state`).

    Blocks of one shape (heads, rows, width) are solved together: their heads are stacked into one batch of
    QR factorisations and eigenproblems (and their head-summed matrices into another), so a ViT's twelve blocks
    take one call per decomposition instead of twelve. Each head's problem is the one :func:`qk_spectra` solves.

    Args:
        state: Flat Q/K/V state (``{block}.q.weight`` / ``{block}.k.weight``).
        heads: Block name -> number of heads.
        summed: Also the head-summed spectra (``QKSpectra.summed``).
        out_device: Where the results are returned (``"cpu"``: one copy per field and shape group); None: where
            they were computed.
        antisymmetric: Also the antisymmetric parts' eigenvalues (``asym_imag``, else None), as in :func:`qk_spectra`.
        executor: A :class:`concurrent.futures.Executor` with a ``threads`` count, e.g. a
            :class:`vitlab.solver_pool.SolverPool`: host batches are solved in that many chunks on its threads (the
            same problems; each one's values do not depend on the chunks). None: in this thread, one batch each.

    Returns:
        Block name -> :class:`QKSpectra` (per head, with ``summed``), in the order of ``heads``.
    """
    groups: dict[tuple, list[str]] = {}
    for block, num_heads in heads.items():
        groups.setdefault((num_heads, tuple(state[f"{block}.q.weight"].shape)), []).append(block)
    solving = []  # every group's problems handed out first (the dense head-summed ones first: the longest)
    for (num_heads, _), members in groups.items():
        split = [_split_heads(state[f"{b}.q.weight"], state[f"{b}.k.weight"], num_heads) for b in members]
        total = None
        if summed:  # each block's whole (H * hd, C) weights as one "head"
            total = _solve(torch.stack([state[f"{b}.q.weight"].detach() for b in members]),
                           torch.stack([state[f"{b}.k.weight"].detach() for b in members]).to(split[0][0].device),
                           antisymmetric, executor)
        per_head = _solve(torch.cat([q for q, _ in split]), torch.cat([k for _, k in split]), antisymmetric, executor)  # (n * H, ...)
        solving.append((num_heads, members, per_head, total))
    out: dict[str, QKSpectra] = {}
    for num_heads, members, per_head, total in solving:
        per_head, total = per_head(), None if total is None else total()
        if out_device is not None:
            per_head = _each_field(per_head, lambda t: t.to(out_device))
            total = None if total is None else _each_field(total, lambda t: t.to(out_device))
        for i, block in enumerate(members):
            head = _each_field(per_head, lambda t: t[i * num_heads: (i + 1) * num_heads])
            out[block] = QKSpectra(**{**head.__dict__, "summed": None if total is None else _each_field(total, lambda t: t[i: i + 1])})
    return {block: out[block] for block in heads}
