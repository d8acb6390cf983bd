"""The planner against published layout sweeps (scripts/planner_calibration.py's data): issue #11's
goal is a Spearman rank correlation of at least 0.7 on every sweep of 10 or more layouts."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests import REPO


@pytest.fixture(scope="module")
def calibration():
    spec = importlib.util.spec_from_file_location("planner_calibration", REPO / "scripts" / "planner_calibration.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_spearman_ranks_with_ties_as_scipy_does(calibration):
    assert calibration.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert calibration.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # scipy.stats.spearmanr([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) = 0.8207826816681233 (ties averaged)
    assert calibration.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.8207826816681233)


def test_every_published_sweep_of_ten_layouts_ranks_with_spearman_of_at_least_0_7(calibration):
    correlations = calibration.sweep_correlations(calibration.results())
    large = {source: rho for source, (layouts, rho) in correlations.items() if layouts >= calibration.MIN_SWEEP}
    assert len(large) >= 2, "the torchtitan and NeMo tables each have 10 or more layouts"
    for source, rho in large.items():
        assert rho >= 0.7, f"{source}: Spearman {rho:.2f}"


def test_every_calibration_point_names_where_its_numbers_come_from(calibration):
    for point in calibration.POINTS:
        assert calibration.SOURCE_URLS[point.source]
