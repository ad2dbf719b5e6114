"""Weight drift between two snapshots of one parameter (the Drotos poster; docs/analyses.md).

A *row* is ``W[r, :]`` of an ``nn.Linear`` weight (out, in): the weights that make output unit r. The
functions here compare the rows of a reference snapshot (e.g. the pretrained weights) with the rows of
the current one, in float64, and summarise them per matrix. They know nothing of model layouts: the
caller splits fused Q/K/V weights and passes plain tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ROW_METRICS", "DRIFT_METRICS", "MATRIX_METRICS", "row_drift", "matrix_drift", "drift_summary", "head_grid", "drift_tables", "extra_drift"]

#: Keys of :func:`row_drift`, in a stable order (also the metrics :func:`matrix_drift` aggregates).
ROW_METRICS: tuple[str, ...] = ("cosine_distance", "euclidean", "mse", "dot", "ref_norm", "cur_norm")

#: Per-row metrics whose means a Q/K/V drift report shows, and its per-matrix metrics.
DRIFT_METRICS: tuple[str, ...] = ("cosine_distance", "euclidean", "mse", "dot")
MATRIX_METRICS: tuple[str, ...] = ("rel_frobenius", "norm_ratio")
_MATRICES = ("q", "k", "v")

_ROW_CHUNK_ELEMENTS = 1 << 17  # CPU: rows are processed in blocks of about this many elements (cache)


def _as_rows(t: Tensor) -> Tensor:
    """View a parameter as (rows, d_in): 1-D -> (n, 1); N-D -> (shape[0], prod(rest))."""
    return t.reshape(-1, 1) if t.ndim == 1 else t.reshape(t.shape[0], -1)


def _check_pair(ref: Tensor, cur: Tensor) -> None:
    if not isinstance(ref, Tensor) or not isinstance(cur, Tensor):
        raise TypeError(f"row_drift: ref and cur must be tensors, got {type(ref).__name__} and {type(cur).__name__}")
    if ref.shape != cur.shape:
        raise ValueError(
            f"row_drift: ref shape {tuple(ref.shape)} != cur shape {tuple(cur.shape)}; "
            "pass two snapshots of the same parameter"
        )
    if ref.ndim == 0 or ref.numel() == 0:
        raise ValueError(f"row_drift: need a non-empty tensor with at least 1 dimension, got shape {tuple(ref.shape)}")
    if ref.is_complex() or ref.dtype == torch.bool:
        raise ValueError(f"row_drift: need real-valued tensors, got dtype {ref.dtype}")


def row_drift(ref: Tensor, cur: Tensor) -> dict[str, Tensor]:
    """Per-row comparison of two snapshots of one weight.

    For rows u = ref[r], v = cur[r] (d_in entries each), in float64:
    ``cosine_distance`` 1 - u.v/(|u||v|) (0 when both rows are zero, 1 when exactly one is),
    ``euclidean`` |u - v|, ``mse`` |u - v|^2 / d_in, ``dot`` u.v, ``ref_norm`` |u|, ``cur_norm`` |v|.
    A 1-D tensor (a bias) is compared elementwise (d_in = 1); a tensor with more than 2 dimensions
    (a conv kernel) is flattened to (shape[0], -1).

    The cosine distance is evaluated as (|u-v|^2 - (|u|-|v|)^2) / (2|u||v|), which equals 1 - cos but keeps
    full relative precision for the tiny drifts of early fine-tuning (1 - cos cancels catastrophically).

    Args:
        ref: reference snapshot, (out, in) or (out,) or (out, ...), any real dtype.
        cur: current snapshot, same shape as ``ref`` (moved to ``ref``'s device if needed).

    Returns:
        Dict of float64 tensors of shape (out,), keyed as in :data:`ROW_METRICS`.

    Raises:
        ValueError: shapes differ, or the tensor is 0-D / empty.
    """
    _check_pair(ref, cur)
    u_all = _as_rows(ref.detach())  # (R, D)
    v_all = _as_rows(cur.detach().to(ref.device))  # (R, D)
    rows, d_in = u_all.shape
    opts = dict(dtype=torch.float64, device=ref.device)
    gram = torch.empty(rows, 2, 2, **opts)  # (R, 2, 2): [[u.u, u.v], [v.u, v.v]] per row
    diff_sq = torch.empty(rows, **opts)  # (R,)
    # On CPU, blocks of rows small enough that every pass over a block stays in cache; on GPU one block.
    step = max(1, _ROW_CHUNK_ELEMENTS // d_in) if ref.device.type == "cpu" else rows
    pair = torch.empty(min(step, rows), 2, d_in, **opts)  # (r, 2, D): u and v of a block, float64
    diff = torch.empty(min(step, rows), d_in, **opts)  # (r, D)
    for start in range(0, rows, step):
        sl = slice(start, min(start + step, rows))
        n = sl.stop - sl.start
        uv, d = pair[:n], diff[:n]
        uv[:, 0].copy_(u_all[sl])
        uv[:, 1].copy_(v_all[sl])
        torch.bmm(uv, uv.mT, out=gram[sl])
        torch.sub(uv[:, 1], uv[:, 0], out=d)  # exact difference in float64, no cancellation later
        torch.linalg.vecdot(d, d, out=diff_sq[sl])
    ref_sq, dot, cur_sq = gram[:, 0, 0], gram[:, 0, 1], gram[:, 1, 1]  # (R,) each
    ref_norm, cur_norm = ref_sq.sqrt(), cur_sq.sqrt()
    norm_prod = ref_norm * cur_norm
    gap = ref_norm - cur_norm
    cosine = ((diff_sq - gap * gap) / (2.0 * norm_prod)).clamp_(0.0, 2.0)
    # Zero rows: distance 0 when both are zero, 1 when only one is (cosine undefined there).
    one_zero = (ref_sq == 0) ^ (cur_sq == 0)
    both_zero = (ref_sq == 0) & (cur_sq == 0)
    cosine = torch.where(both_zero, 0.0, torch.where(one_zero, 1.0, cosine))
    return {
        "cosine_distance": cosine,
        "euclidean": diff_sq.sqrt(),
        "mse": diff_sq / d_in,
        "dot": dot.clone(),
        "ref_norm": ref_norm,
        "cur_norm": cur_norm,
    }


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """num / den with 0/0 -> 0 and x/0 -> inf (a zero reference has no relative scale)."""
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.where(num > 0, torch.inf, 0.0))


def matrix_drift(ref: Tensor, cur: Tensor) -> dict[str, float]:
    """Whole-matrix drift summary (the Drotos poster's "global view").

    Args:
        ref: reference snapshot (see :func:`row_drift` for accepted shapes).
        cur: current snapshot, same shape.

    Returns:
        ``rel_frobenius`` |W_cur - W_ref|_F / |W_ref|_F, ``norm_ratio`` |W_cur|_F / |W_ref|_F (0/0 -> 0,
        x/0 -> inf), and ``{metric}_mean``, ``{metric}_median``, ``{metric}_max`` over rows for every
        metric in :data:`ROW_METRICS`. The median is the midpoint median (as numpy), not torch's lower one.
    """
    return drift_summary(row_drift(ref, cur))


def drift_summary(rows: dict[str, Tensor]) -> dict[str, float]:
    """The :func:`matrix_drift` summary from an existing :func:`row_drift` result (no recomputation)."""
    frob_diff = rows["euclidean"].square().sum().sqrt()
    frob_ref = rows["ref_norm"].square().sum().sqrt()
    frob_cur = rows["cur_norm"].square().sum().sqrt()
    names = ["rel_frobenius", "norm_ratio"]
    values = [_ratio(frob_diff, frob_ref), _ratio(frob_cur, frob_ref)]
    for metric in ROW_METRICS:
        col = rows[metric]  # (R,)
        names += [f"{metric}_mean", f"{metric}_median", f"{metric}_max"]
        values += [col.mean(), torch.quantile(col, 0.5), col.max()]
    return dict(zip(names, torch.stack(values).tolist()))  # one device sync for all numbers


def head_grid(values: Tensor, num_heads: int) -> Tensor:
    """Reshape a per-row vector of a Q, K or V matrix into the heads x rows heatmap (the "local view").

    Args:
        values: (C,) one value per row, rows ordered head by head (head h = rows h*hd:(h+1)*hd).
        num_heads: number of heads H; must divide C.

    Returns:
        (H, hd) view of ``values``; row h is head h.
    """
    if values.ndim != 1:
        raise ValueError(f"head_grid: values must be 1-D (one value per row), got shape {tuple(values.shape)}")
    if num_heads < 1 or values.numel() % num_heads:
        raise ValueError(f"head_grid: num_heads={num_heads} must be >= 1 and divide the {values.numel()} rows")
    return values.reshape(num_heads, values.numel() // num_heads)


def drift_tables(
    ref: dict[str, Tensor], cur: dict[str, Tensor], blocks: list[str], out_device: str | torch.device | None = None
) -> tuple[dict[tuple[str, str], dict[str, Tensor]], dict[tuple[str, str], dict[str, float]]]:
    """Per-row drift and per-matrix summaries of every (block, Q|K|V) weight between two flat Q/K/V states
    (``{block}.{q|k|v}.weight`` keys, see :func:`vitlab.qkv.state.qkv_state`).

    Matrices whose rows have the same width are stacked and compared in one :func:`row_drift` call, and every
    summary is reduced in one pass per metric; the summaries reach the host in one transfer.

    Args:
        ref: Reference state.
        cur: Current state (same keys and shapes).
        blocks: Block names to compare.
        out_device: Where the per-row tensors are returned (e.g. ``"cpu"`` for states on a GPU: one copy per
            metric and row width, not one per matrix); None: where they were computed.

    Returns:
        rows: (block, matrix) -> ``row_drift`` output (per-row float64 tensors).
        summary: (block, matrix) -> row-metric means plus ``rel_frobenius`` (||cur - ref||_F / ||ref||_F)
        and ``norm_ratio`` (||cur||_F / ||ref||_F).
    """
    keys = [(block, m) for block in blocks for m in _MATRICES]
    by_width: dict[tuple[int, ...], list[tuple[str, str]]] = {}
    for key in keys:
        by_width.setdefault(tuple(ref[f"{key[0]}.{key[1]}.weight"].shape[1:]), []).append(key)
    rows: dict[tuple[str, str], dict[str, Tensor]] = {}
    columns: list[Tensor] = []  # (matrices, 2 + len(DRIFT_METRICS)) per width group
    order: list[tuple[str, str]] = []
    for members in by_width.values():
        names = [f"{block}.{m}.weight" for block, m in members]
        sizes = [ref[name].shape[0] for name in names]
        stacked = row_drift(torch.cat([ref[name] for name in names]), torch.cat([cur[name] for name in names]))  # (sum R,)
        device = stacked["dot"].device
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))

        def per_matrix(values: Tensor) -> Tensor:  # (sum R,) -> (matrices,) sums over each matrix's rows
            return torch.zeros(len(sizes), dtype=values.dtype, device=device).index_add_(0, segment, values)

        count = torch.tensor(sizes, dtype=torch.float64, device=device)
        frob_diff = per_matrix(stacked["euclidean"].square()).sqrt()
        frob_ref = per_matrix(stacked["ref_norm"].square()).sqrt()
        frob_cur = per_matrix(stacked["cur_norm"].square()).sqrt()
        columns.append(torch.stack([_ratio(frob_diff, frob_ref), _ratio(frob_cur, frob_ref),
                                    *(per_matrix(stacked[name]) / count for name in DRIFT_METRICS)], dim=1))
        order += members
        if out_device is not None:
            stacked = {name: values.to(out_device) for name, values in stacked.items()}
        parts = {name: values.split(sizes) for name, values in stacked.items()}
        for i, key in enumerate(members):
            rows[key] = {name: parts[name][i] for name in parts}
    values = torch.cat(columns).tolist() if columns else []  # one transfer for every summary
    summary = {key: {**dict(zip(DRIFT_METRICS, row[2:])), "rel_frobenius": row[0], "norm_ratio": row[1]}
               for key, row in zip(order, values)}
    return {key: rows[key] for key in keys}, {key: summary[key] for key in keys}


def extra_drift(ref: dict[str, Tensor], cur: dict[str, Tensor]) -> dict[str, float]:
    """Absolute Frobenius change ||cur - ref||_F of biases and relative-position tables (``key`` -> value).

    Absolute, not relative: biases commonly start at zero, where a relative change has no scale.
    """
    keys = [key for key in cur if not key.endswith(".weight") and key in ref]
    if not keys:
        return {}
    norms = torch.stack([(cur[key].double() - ref[key].double()).norm() for key in keys])  # (keys,) one transfer
    return dict(zip(keys, norms.tolist()))
