"""The candidate rules bench/lr_find_rules.py measures against lr_find.py's and lr_find.py dropped
(docs/lr_find.md, "How good the suggestions are"): valley and steepest, read from lr_find's curve."""

import numpy as np
import pytest
from test_lr_find import curve_lrs, hand_curve, reference_curve, sweep_of_synthetic_curve, synthetic_curve

import bench.lr_find_rules as rules
import lr_find as lf


@pytest.mark.parametrize("lr_star", [3e-5, 1e-3, 3e-2])
@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_a_sweep_places_the_steepest_point_and_the_valley(lr_star, noise):
    result = sweep_of_synthetic_curve(lr_star, noise)
    curve = lf.suggestion_curve(result.lrs, result.losses)
    assert lr_star / 2 <= rules.steepest(curve) <= lr_star * 2
    assert lr_star <= rules.valley(curve) <= 4 * lr_star


def test_on_a_clean_curve_and_through_spikes():
    lrs = [10 ** (-7 + 8 * i / 99) for i in range(100)]
    losses = [synthetic_curve(1e-2, k=1.5)(lr) for lr in lrs]
    assert 0.5e-2 <= rules.steepest(lf.suggestion_curve(lrs, losses)) <= 2e-2
    assert 1e-2 <= rules.valley(lf.suggestion_curve(lrs, losses)) <= 4e-2
    spiky = list(losses)
    spiky[30] *= 3
    spiky[45] *= 3
    assert 0.5e-2 <= rules.steepest(lf.suggestion_curve(lrs, spiky)) <= 2e-2, "a lone spike is not a descent"


@pytest.mark.parametrize("spacing", ["dense", "coarse"])
def test_slopes_are_central_differences_per_decade(spacing):
    rng = np.random.default_rng(0)
    gaps = [0.07] * 59 if spacing == "dense" else [0.29, 0.1] * 12 + [0.29] * 5
    x = -5 + np.concatenate([[0.0], np.cumsum(gaps)])
    lrs = (10**x).tolist()
    losses = (2 - np.tanh(2 * (x - x.mean())) + 0.3 * rng.standard_normal(len(x))).tolist()
    _, slope = reference_curve(lrs, losses)
    assert rules.slope_per_decade(lf.suggestion_curve(lrs, losses)) == pytest.approx(
        slope.tolist(), rel=1e-9, abs=1e-12)
    lrs = curve_lrs(20)
    twice = lf.suggestion_curve([lrs[0], *lrs], [1.0, *[1.0 - i / 40 for i in range(20)]])
    assert rules.slope_per_decade(twice)[0] == 0.0, "a repeated lr is no division by 0"


VALLEYS = [  # (loss, index valley picks or None); first = 2
    ([5, 20, 8, 7, 6.5, 8, 9, 9.5], 3),  # 2/3 of the fall from 8 to 6.5 is 7: reached exactly at 3
    ([9, 9, 5, 6, 5.5, 5, 4.8, 9], 5),  # a rise right after `first` starts the run at 3
    ([9, 9, 20, 10, 10, 9, 8.9, 30], 5),  # a flat step ends a run
    ([9, 9, 10, 8, 9, 7, 8, 6, 20], None),  # never two falls in a row
    ([9, 9, 10, 8, 7, 6, 9, 8.5, 20], 4),  # the longest run wins over a later short one
    ([9, 9, 10, 8, 7, 12, 11, 10.5, 30], 3),  # equally long: the first; two falls are enough
    ([1, 1, 10, 8, 7, 12, 30], 3),  # the pick lies in the run, not before it
    ([9, 9, 10, 9.9, 9.8, 4, 30], 5),  # 2/3 of the drop reached only at its end
]


@pytest.mark.parametrize(("loss", "index"), VALLEYS)
def test_valley_on_hand_made_curves(loss, index):
    curve = hand_curve([float(v) for v in loss])
    assert rules.valley(curve) == (None if index is None else curve.lrs[index])


def test_steepest_on_hand_made_curves(monkeypatch):
    def curve_with(n: int, slopes: dict[int, float], lowest: int) -> lf.SuggestionCurve:
        slope = [-1.0] * n
        for i, v in slopes.items():
            slope[i] = v
        monkeypatch.setattr(rules, "slope_per_decade", lambda curve: slope)
        return lf.SuggestionCurve(curve_lrs(n), [0.0] * n, max(2, n // 10), lowest, True, None)

    # never before `first`, never in the last 5% (at least 2 points), up to the lowest point
    c = curve_with(50, {1: -500.0, 47: -100.0, 48: -200.0, 49: -300.0}, lowest=49)
    assert rules.steepest(c) == c.lrs[47]
    c = curve_with(60, {57: -100.0, 58: -200.0}, lowest=59)
    assert rules.steepest(c) == c.lrs[6]
    c = curve_with(30, {15: -50.0, 20: -80.0}, lowest=15)
    assert rules.steepest(c) == c.lrs[15]
    # None when nothing up to the lowest point falls: a dip below `first` makes every slope >= 0
    monkeypatch.undo()
    for left in (0.5, 0.9):
        c = hand_curve([0.4, left, 1.0, 0.9, 5.0, 6.0, 7.0, 8.0], spacing=1.0)
        assert c.lowest == 3 and min(rules.slope_per_decade(c)[2:4]) >= 0
        assert rules.steepest(c) is None


