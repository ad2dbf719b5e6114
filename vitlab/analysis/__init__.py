"""Pure tensor analyses: tensors in, tensors / dataclasses out (no Lightning, no files, no logging).

Every formula of docs/analyses.md lives here once; callbacks and probes gather tensors through
``vitlab.models`` and call these functions.
"""

from vitlab.analysis.drift import (
    DRIFT_METRICS,
    MATRIX_METRICS,
    ROW_METRICS,
    drift_summary,
    drift_tables,
    extra_drift,
    head_grid,
    matrix_drift,
    row_drift,
)
from vitlab.analysis.moments import Moments, central_moments, merge_moments
from vitlab.analysis.probing import ProbeScore, balanced_accuracy, knn_probe, linear_probe, weighted_knn
from vitlab.analysis.mi import (
    MIDistanceCurves,
    binned_mi,
    copula_normalize,
    gaussian_copula_mi,
    ksg_mi,
    mi_vs_distance,
)
from vitlab.analysis.attention_geometry import DistanceStats, attention_vs_distance, merge_distance_stats, orthogonal_planes, query_token, token_centres, window_pairs
from vitlab.analysis.rollout import attention_rollout, pool_tokens, rollout_map
from vitlab.analysis.spectra import QKSpectra, block_spectra, effective_rank, qk_matrices, qk_spectra
from vitlab.analysis.stats import AngleStats, attention_vs_angle, excess_kurtosis, linear_cka

__all__ = [
    "Moments",
    "central_moments",
    "merge_moments",
    "ProbeScore",
    "balanced_accuracy",
    "knn_probe",
    "linear_probe",
    "weighted_knn",
    "ROW_METRICS",
    "DRIFT_METRICS",
    "MATRIX_METRICS",
    "drift_tables",
    "extra_drift",
    "block_spectra",
    "row_drift",
    "matrix_drift",
    "drift_summary",
    "head_grid",
    "QKSpectra",
    "qk_spectra",
    "qk_matrices",
    "effective_rank",
    "MIDistanceCurves",
    "copula_normalize",
    "gaussian_copula_mi",
    "binned_mi",
    "ksg_mi",
    "mi_vs_distance",
    "excess_kurtosis",
    "linear_cka",
    "AngleStats",
    "attention_vs_angle",
    "attention_rollout",
    "rollout_map",
    "pool_tokens",
    "DistanceStats",
    "attention_vs_distance",
    "merge_distance_stats",
    "orthogonal_planes",
    "query_token",
    "token_centres",
    "window_pairs",
]
