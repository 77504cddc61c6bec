"""The data-scaling trend of a sorted draft: held-out agreement per exit against the unique
supervised tokens it was trained on, its fit, and how many tokens a target level needs.

A point is one trained draft measured on the held-out set: (shape, supervision kind,
unique tokens, exit, agreement, its standard error). Over the range this study can reach
on a CPU (0.1M-10M tokens) agreement grows about linearly in log tokens, so the trend is
    agreement = a + b * log10(tokens)
fitted by generalised least squares: the points' errors are their own s.e., and where
every point of a series was scored on the same held-out answers (per-prompt hits in the
points file, as the study writes them) also their covariance, clustered by prompt as each
s.e. is (a hard prompt is hard for every draft: points on shared prompts err together, and
the trend through them is better known than independent errors would say). The fit's
covariance is scaled by its reduced chi-square when that exceeds 1, so a trend that does
not follow the points gets wider errors, not narrower. The tokens a level L needs are
10^((L - a) / b); their error comes from the fit's covariance (delta method on
log10 tokens). A log-linear trend cannot saturate, so beyond the measured range it is an
estimate of where to look, not a promise: the report says how far it extrapolates.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from s2d_jax.errors import S2DError
from s2d_jax.readers import parse_json, read_text

KINDS = ("on_policy", "teacher_forced")
FIELDS = ("shape", "kind", "tokens", "exit", "agreement", "se")
PAIRED = ("prompt_hits", "prompt_tokens")  # optional: per held-out prompt
OPTIONAL = ("recipe",)


@dataclasses.dataclass(frozen=True)
class Point:
    """One trained draft's held-out agreement at one exit."""

    shape: str      # the draft's shape, e.g. "4 layers"
    kind: str       # supervision: on-policy answers or teacher-forced text (KINDS)
    tokens: int     # unique supervised tokens it was trained on
    exit: int
    agreement: float
    se: float       # standard error of `agreement` (clustered by prompt)
    prompt_hits: tuple = ()     # per held-out prompt: answer tokens the exit predicted
    prompt_tokens: tuple = ()   # per held-out prompt: answer tokens
    # "": the study's recipe (configs/train/scaling_study.yaml); another name is a draft
    # trained otherwise (e.g. one pass over the committed corpus), its own series, so a
    # recipe's points never bend the study's trends
    recipe: str = ""

    @property
    def supervision(self) -> str:
        return f"{self.kind} ({self.recipe})" if self.recipe else self.kind


@dataclasses.dataclass(frozen=True)
class Fit:
    """agreement = a + b * log10(tokens), with the covariance of (a, b)."""

    a: float
    b: float
    cov: np.ndarray
    points: int
    chi2_dof: float  # reduced chi-square of the weighted fit (1 = scatter as the s.e. say)
    token_range: tuple[int, int]
    paired: int = 0  # prompts the points' covariance was taken over (0: independent errors)

    def at(self, tokens: float) -> float:
        return self.a + self.b * math.log10(tokens)

    def tokens_for(self, level: float) -> tuple[float, float, float]:
        """(tokens, low, high) the trend says reach `level`; low/high: +-1 s.e. on
        log10 tokens. inf when the trend does not rise."""
        if not self.b > 0:
            return math.inf, math.inf, math.inf
        x = (level - self.a) / self.b
        # d x / d a = -1 / b, d x / d b = -x / b
        grad = np.array([-1.0 / self.b, -x / self.b])
        sx = float(math.sqrt(max(grad @ self.cov @ grad, 0.0)))
        return _pow10(x), _pow10(x - sx), _pow10(x + sx)


def _pow10(x: float) -> float:
    return math.inf if x > 300 else 10 ** x  # a flat trend: "never", not an overflow


def check_point(p: Point, where: str) -> Point:
    """A point read from a file gets the checks a flag would."""
    if not (isinstance(p.shape, str) and p.shape.strip()):
        raise S2DError(f"{where}: shape must be a non-empty string such as '4 layers', got "
                       f"{p.shape!r}")
    if p.exit < 1:
        raise S2DError(f"{where}: exit must be >= 1, got {p.exit}")
    if not isinstance(p.recipe, str) or p.recipe != p.recipe.strip() or "|" in p.recipe:
        raise S2DError(f"{where}: recipe must be a name without '|' or outer spaces "
                       f"(leave it out for the study's), got {p.recipe!r}")
    if p.kind not in KINDS:
        raise S2DError(f"{where}: kind {p.kind!r} is not one of {list(KINDS)}")
    if not (isinstance(p.tokens, int) and p.tokens > 0):
        raise S2DError(f"{where}: tokens must be a positive integer, got {p.tokens!r}")
    for name in ("agreement", "se"):
        v = getattr(p, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 1):
            raise S2DError(f"{where}: {name} must be a finite number in [0, 1], got {v!r}")
    if p.se <= 0:
        raise S2DError(f"{where}: se must be > 0 (a point without an error cannot be "
                       "weighted); measure it on more held-out tokens")
    if p.prompt_hits or p.prompt_tokens:
        hits, tokens = p.prompt_hits, p.prompt_tokens
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (*hits, *tokens)) if isinstance(hits, tuple) and \
            isinstance(tokens, tuple) else False
        if not (ints and len(hits) == len(tokens) > 0 and all(h <= t for h, t in zip(hits, tokens))
                and abs(sum(hits) / max(sum(tokens), 1) - p.agreement) < 1e-6):
            raise S2DError(f"{where}: prompt_hits and prompt_tokens must be lists of whole "
                           f"numbers >= 0 of one length, hits <= tokens, their ratio the "
                           f"agreement; rewrite the point (the study writes them)")
    return p


def point_covariance(points: list[Point]) -> np.ndarray | None:
    """The covariance of the points' agreements, clustered by prompt (the diagonal is each
    point's s.e.^2 as bench/agreement.py computes it), when every point holds per-prompt
    hits on the same answers; None otherwise."""
    if not all(p.prompt_hits for p in points) or len({p.prompt_tokens for p in points}) != 1:
        return None
    n = np.asarray(points[0].prompt_tokens, np.float64)
    hits = np.asarray([p.prompt_hits for p in points], np.float64)  # [points, prompts]
    resid = hits - (hits.sum(1) / n.sum())[:, None] * n[None, :]
    return resid @ resid.T / n.sum() ** 2


def fit_log_linear(points: list[Point]) -> Fit:
    """Generalised least squares of agreement on log10(tokens) over points of one series
    (one shape, kind and exit): errors from point_covariance where the points share their
    prompts, else independent (their s.e.). Needs >= 3 points at >= 2 token counts."""
    if len(points) < 3 or len({p.tokens for p in points}) < 2:
        raise S2DError(f"a trend needs >= 3 points at >= 2 token counts, got {len(points)}")
    x = np.log10([p.tokens for p in points])
    y = np.array([p.agreement for p in points])
    paired = point_covariance(points)
    X = np.stack([np.ones_like(x), x], axis=1)
    cov = W = None
    if paired is not None:
        W = np.linalg.pinv(paired)  # pinv: two identical drafts give a singular covariance
        try:  # a few held-out prompts cannot weigh many points: singular, use their s.e.
            cov = np.linalg.inv(X.T @ W @ X)
        except np.linalg.LinAlgError:
            paired = None
        if cov is not None and not np.all(np.isfinite(cov)):
            paired = None
    if paired is None:
        W = np.diag(1.0 / np.array([p.se for p in points]) ** 2)
        cov = np.linalg.inv(X.T @ W @ X)
    a, b = cov @ X.T @ W @ y
    dof = len(points) - 2
    r = y - a - b * x
    chi2_dof = float(r @ W @ r / dof) if dof else 1.0
    cov = cov * max(1.0, chi2_dof)
    tokens = [p.tokens for p in points]
    return Fit(float(a), float(b), cov, len(points), chi2_dof, (min(tokens), max(tokens)),
               0 if paired is None else len(points[0].prompt_hits))


def series(points: list[Point]) -> dict[tuple[str, str, int], list[Point]]:
    """Points grouped by (shape, supervision: kind and recipe, exit), each sorted by tokens."""
    out: dict[tuple[str, str, int], list[Point]] = {}
    for p in points:
        out.setdefault((p.shape, p.supervision, p.exit), []).append(p)
    return {k: sorted(v, key=lambda p: p.tokens) for k, v in sorted(out.items())}


def _tokens(n: float) -> str:
    if not math.isfinite(n):
        return "never"
    if n >= 1e9:
        return f"{n / 1e9:.3g}B"
    return f"{n / 1e6:.3g}M" if n >= 1e5 else f"{n / 1e3:.3g}k"


def table_lines(points: list[Point], levels=(0.35, 0.45)) -> list[str]:
    """Markdown: every point, then each series' fit and the tokens each level needs."""
    lines = ["| shape | supervision | unique tokens | exit | agreement (s.e.) |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {p.shape} | {p.supervision} | {_tokens(p.tokens)} | {p.exit} | "
              f"{p.agreement:.3f} ({p.se:.3f}) |" for p in sorted(
                  points, key=lambda p: (p.shape, p.supervision, p.exit, p.tokens))]
    fit_rows = []
    for (shape, kind, ex), pts in series(points).items():
        if len(pts) < 3:
            continue
        f = fit_log_linear(pts)
        cells = []
        for level in levels:
            n, lo, hi = f.tokens_for(level)
            reach = n / f.token_range[1]
            cells.append(f"{_tokens(n)} ({_tokens(lo)}-{_tokens(hi)}; "
                         f"{reach:.3g}x the largest point)")
        errors = f"paired over {f.paired} prompts" if f.paired else "independent errors"
        fit_rows.append(f"| {shape} | {kind} | {ex} | {f.a:.3f} + {f.b:.3f} log10 N "
                        f"(s.e. {math.sqrt(f.cov[1, 1]):.3f}; chi2/dof {f.chi2_dof:.2f}; "
                        f"{errors}) | "
                        + " | ".join(cells) + " |")
    if fit_rows:
        lines += ["", "| shape | supervision | exit | fit | "
                  + " | ".join(f"tokens for {level}" for level in levels) + " |",
                  "| --- | --- | --- | --- | " + " | ".join("---" for _ in levels) + " |"]
        lines += fit_rows
    return lines


def plot(points: list[Point], path: str) -> bool:
    """Agreement against unique tokens (log x), one panel per shape (sharing the y axis),
    one marker series per (kind, exit) with its error bars and fitted trend (dashed, on to
    10x the largest point); False (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({p.shape for p in points}, key=lambda s: (len(s), s))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.5), sharey=True,
                             squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for (_, supervision, ex), pts in series([p for p in points if p.shape == shape]).items():
            t = np.array([p.tokens for p in pts], dtype=float)
            marker = "*" if pts[0].recipe else "o" if pts[0].kind == "on_policy" else "s"
            line = ax.errorbar(t, [p.agreement for p in pts], yerr=[p.se for p in pts],
                               marker=marker, markersize=9 if pts[0].recipe else 6,
                               linestyle="none",
                               capsize=3, label=f"{supervision}, exit {ex}")
            if len(pts) >= 3:
                f = fit_log_linear(pts)
                grid = np.geomspace(t.min(), t.max() * 10, 50)
                ax.plot(grid, [f.at(g) for g in grid], "--", color=line[0].get_color(), lw=1)
        ax.set_xscale("log")
        ax.set_title(f"{shape}")
        ax.set_xlabel("unique supervised tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out greedy agreement")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def read_points(path: str):
    points = []
    for n, line in enumerate(read_text(path, "points file").splitlines(), 1):
        if not line.strip():
            continue
        row = parse_json(line, path, "points file", n)
        if not isinstance(row, dict) or set(FIELDS) - set(row):
            raise S2DError(f"points file {path}:{n} needs the fields {list(FIELDS)}; "
                           "see python -m infer.scaling_report --help")
        if isinstance(row["tokens"], bool) or isinstance(row["exit"], bool) \
                or not isinstance(row["exit"], int):
            raise S2DError(f"points file {path}:{n}: tokens and exit must be integers")
        extra = {k: tuple(row[k]) if isinstance(row.get(k), list) else row.get(k)
                 for k in PAIRED if k in row}
        extra.update({k: row[k] for k in OPTIONAL if k in row})
        points.append(check_point(Point(**{k: row[k] for k in FIELDS}, **extra),
                                  f"points file {path}:{n}"))
    if not points:
        raise S2DError(f"points file {path} has no points; run the study first")
    return points


def fits_record(points: list[Point], levels) -> dict:
    """fits.json: every series of >= 3 points, its fit and the tokens each level needs."""
    fits = {}
    for (shape, kind, ex), pts in series(points).items():
        if len(pts) >= 3:
            f = fit_log_linear(pts)
            fits[f"{shape} | {kind} | exit {ex}"] = {
                "a": f.a, "b": f.b, "cov": f.cov.tolist(), "chi2_dof": f.chi2_dof,
                "paired_prompts": f.paired,
                "token_range": list(f.token_range),
                "tokens_for": {str(v): list(f.tokens_for(v)) for v in levels}}
    return fits


def write_report(points: list[Point], out: str, levels=(0.35, 0.45)) -> tuple[list[str], str]:
    """OUT/table.md, fits.json, scaling.png (rewritten: derived from the points);
    -> (the table's lines, what was written)."""
    import json
    import os

    from s2d_jax.bench.report import PLOT_EXTRA
    from s2d_jax.io.atomic import write_atomic
    lines = table_lines(points, tuple(levels))
    os.makedirs(out, exist_ok=True)
    write_atomic(os.path.join(out, "table.md"), "\n".join(lines) + "\n")
    write_atomic(os.path.join(out, "fits.json"),
                 json.dumps(fits_record(points, levels), indent=1) + "\n")
    if plot(points, os.path.join(out, "scaling.png")):
        return lines, f"wrote {out}/table.md, fits.json, scaling.png"
    return lines, (f"wrote {out}/table.md, fits.json; scaling.png skipped: matplotlib is not "
                   f"installed ({PLOT_EXTRA})")
