"""The export skeleton both model families fill in: parity checks and package helpers."""

from __future__ import annotations

import numpy as np

PARITY_SPLIT = "test"


def max_abs_diff(expected: np.ndarray, actual: np.ndarray) -> float:
    if expected.shape != actual.shape:
        return float("inf")
    return float(np.max(np.abs(expected.astype(np.float64) - actual.astype(np.float64))))
