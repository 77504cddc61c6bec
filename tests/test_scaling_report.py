"""The data-scaling study's fit and report (s2d_jax/bench/scaling.py, infer.scaling_report)."""

import json
import math

import numpy as np
import pytest

from infer import scaling_report
from s2d_jax.bench.scaling import Point, fit_log_linear, point_covariance


def _points(a=0.05, b=0.05, se=0.01, noise=None, kind="on_policy", exit=4):
    tokens = [200_000, 500_000, 1_000_000, 2_000_000]
    noise = noise or [0.0] * len(tokens)
    return [Point("4 layers", kind, t, exit, a + b * math.log10(t) + e, se)
            for t, e in zip(tokens, noise)]


def test_the_fit_recovers_a_planted_trend_and_the_tokens_a_level_needs():
    f = fit_log_linear(_points(a=-0.1, b=0.06))
    assert f.a == pytest.approx(-0.1) and f.b == pytest.approx(0.06)
    n, lo, hi = f.tokens_for(0.35)
    assert n == pytest.approx(10 ** (0.45 / 0.06), rel=1e-9)
    assert lo < n < hi


def test_scatter_beyond_the_errors_widens_the_fit_not_narrows_it():
    tight = fit_log_linear(_points(noise=[0.0, 0.0, 0.0, 0.0]))
    scattered = fit_log_linear(_points(noise=[0.03, -0.03, 0.03, -0.03]))
    assert scattered.chi2_dof > 1
    assert scattered.cov[1, 1] > tight.cov[1, 1] * scattered.chi2_dof * 0.99


def test_a_trend_that_does_not_rise_needs_infinitely_many_tokens():
    f = fit_log_linear(_points(b=0.0))
    assert f.tokens_for(0.35)[0] == math.inf


def _paired_points(b=0.05, seed=0, prompts=40):
    """Drafts scored on the same prompts: a prompt's difficulty is shared by every point."""
    rng = np.random.default_rng(seed)
    n = rng.integers(20, 90, prompts)
    difficulty = rng.uniform(-0.15, 0.15, prompts)
    pts = []
    for t in (10_000, 20_000, 45_000, 90_000):
        p = np.clip(-0.03 + b * math.log10(t) + difficulty, 0.0, 1.0)
        hits = rng.binomial(n, p)
        agreement = hits.sum() / n.sum()
        se = math.sqrt(((hits - agreement * n) ** 2).sum()) / n.sum()  # as bench/agreement.py
        pts.append(Point("4 layers", "on_policy", t, 4, float(agreement), se,
                         tuple(int(h) for h in hits), tuple(int(x) for x in n)))
    return pts


def test_points_on_shared_prompts_fit_a_tighter_trend_than_independent_errors_say():
    pts = _paired_points()
    np.testing.assert_allclose(np.diag(point_covariance(pts)), [p.se ** 2 for p in pts],
                               rtol=1e-9)
    paired = fit_log_linear(pts)
    alone = fit_log_linear([Point(*[getattr(p, k) for k in ("shape", "kind", "tokens", "exit",
                                                            "agreement", "se")]) for p in pts])
    assert paired.paired == 40 and alone.paired == 0
    assert math.sqrt(paired.cov[1, 1]) < 0.5 * math.sqrt(alone.cov[1, 1])
    assert abs(paired.b - 0.05) < 3 * math.sqrt(paired.cov[1, 1])
    # other answers (another held-out set) for one point: no shared covariance
    mixed = pts[:3] + [Point(*[getattr(pts[3], k) for k in ("shape", "kind", "tokens", "exit",
                                                           "agreement", "se")],
                             pts[3].prompt_hits[:-1], pts[3].prompt_tokens[:-1])]
    assert point_covariance(mixed) is None


def _write(path, points):
    path.write_text("".join(json.dumps(p.__dict__) + "\n" for p in points))


def test_the_report_writes_table_fits_and_plot(tmp_path, capsys):
    pts = _points() + _points(kind="teacher_forced", b=0.04)
    _write(tmp_path / "points.jsonl", pts)
    out = tmp_path / "report"
    assert scaling_report.main(["--points", str(tmp_path / "points.jsonl"), "--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    assert table.count("| 4 layers |") == len(pts) + 2  # every point and both fits
    fits = json.loads((out / "fits.json").read_text())
    assert fits["4 layers | on_policy | exit 4"]["b"] == pytest.approx(0.05)
    needed = fits["4 layers | teacher_forced | exit 4"]["tokens_for"]["0.45"][0]
    assert needed == pytest.approx(10 ** ((0.45 - 0.05) / 0.04))
    assert (out / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_a_recipe_is_its_own_series_beside_the_study(tmp_path):
    run = dict(shape="4 layers", kind="on_policy", exit=4, se=0.01, recipe="one pass")
    pts = _points() + [Point(tokens=t, agreement=0.9 - 0.1 * i, **run)
                       for i, t in enumerate((1_000_000, 3_000_000, 5_000_000))]
    _write(tmp_path / "points.jsonl", pts)
    out = tmp_path / "report"
    assert scaling_report.main(["--points", str(tmp_path / "points.jsonl"), "--out", str(out)]) == 0
    fits = json.loads((out / "fits.json").read_text())
    # the falling run leaves the study's planted trend where it was
    assert fits["4 layers | on_policy | exit 4"]["b"] == pytest.approx(0.05)
    assert fits["4 layers | on_policy (one pass) | exit 4"]["b"] < 0
    assert "| 4 layers | on_policy (one pass) | 5M | 4 | 0.700 (0.010) |" in (
        out / "table.md").read_text()


@pytest.mark.parametrize("row, message", [
    ({"shape": "4", "kind": "on_policy", "tokens": 1000, "exit": 4, "agreement": 0.3,
      "se": 0.01, "recipe": 3}, "recipe must be a name"),
    ({"shape": "4", "kind": "on_policy", "tokens": 1000, "exit": 4, "agreement": float("nan"),
      "se": 0.01}, "agreement must be a finite number"),
    ({"shape": "4", "kind": "on_policy", "tokens": 1000, "exit": 4, "agreement": 0.3,
      "se": 0}, "se must be > 0"),
    ({"shape": "4", "kind": "sft", "tokens": 1000, "exit": 4, "agreement": 0.3,
      "se": 0.01}, "kind 'sft'"),
    ({"shape": "4", "kind": "on_policy", "tokens": -5, "exit": 4, "agreement": 0.3,
      "se": 0.01}, "tokens must be a positive integer"),
    ({"shape": "4", "kind": "on_policy", "tokens": 1000, "agreement": 0.3, "se": 0.01},
     "needs the fields"),
    ({"shape": "4", "kind": "on_policy", "tokens": 1000, "exit": 4, "agreement": 0.3,
      "se": 0.01, "prompt_hits": [3, 4], "prompt_tokens": [10, 10]}, "their ratio the agreement"),
    ({"shape": "4", "kind": "on_policy", "tokens": 1000, "exit": 4, "agreement": 0.3,
      "se": 0.01, "prompt_hits": [3, 3], "prompt_tokens": [10]}, "of one length"),
    ({"shape": "4", "kind": "on_policy", "tokens": 1000, "exit": 4, "agreement": 0.3,
      "se": 0.01, "prompt_hits": [-3, 9], "prompt_tokens": [10, 10]}, "whole numbers >= 0"),
    ({"shape": "4", "kind": "on_policy", "tokens": 1000, "exit": 4, "agreement": 0.3,
      "se": 0.01, "prompt_hits": "3,3", "prompt_tokens": [10, 10]}, "whole numbers >= 0"),
])
def test_bad_points_are_refused_with_one_line(tmp_path, capsys, row, message):
    (tmp_path / "p.jsonl").write_text(json.dumps(row).replace("NaN", "NaN") + "\n")
    with pytest.raises(SystemExit) as e:
        scaling_report.main(["--points", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "r")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "r").exists()


def test_the_report_may_not_land_inside_its_input(tmp_path, capsys):
    _write(tmp_path / "points.jsonl", _points())
    with pytest.raises(SystemExit) as e:
        scaling_report.main(["--points", str(tmp_path / "points.jsonl"),
                             "--out", str(tmp_path / "points.jsonl")])
    assert e.value.code == 2
    assert np.isfinite(len((tmp_path / "points.jsonl").read_text()))
    assert (tmp_path / "points.jsonl").read_text().count("\n") == 4
