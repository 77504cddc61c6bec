"""A target's decode setting: its calibrated S2D settings in DIR/s2d_serving.json (written
by infer.calibrate) and `resolve`, the one place where exits, thresholds, gamma and the draft
stop of a method are worked out from the draft, that file and the caller's overrides (for
the API, infer.generate, infer.bench and the calibration alike).

Schema: {"thresholds": [per exit, in [0, 1], the last usually 0], "gamma": >= 1,
"stop_threshold": in [0, 1] (0 = always gamma draft tokens; optional), "exits": [layer
counts] (optional: default the draft's), plus informational fields (`serving_record`):
the draft dir, the measured and predicted speedups and what it was calibrated on.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Sequence

from s2d_jax.decode.checks import check_lookup, check_stop_threshold, check_thresholds
from s2d_jax.decode.defaults import max_gamma
from s2d_jax.decode.methods import (DEFAULT_GAMMA, DEFAULT_NGRAM, PAPER_THRESHOLD, methods_where,
                                    proposer)
from s2d_jax import validate
from s2d_jax.errors import S2DError
from s2d_jax.model.exits import exits_problem
from s2d_jax.io.atomic import write_atomic
from s2d_jax.readers import read_text

SERVING_CONFIG = "s2d_serving.json"
# the methods calibrated in a section of their own ("lookup": {...}); s2d: the top level
SECTIONS = tuple(m for m in methods_where() if proposer(m).serving_section)


def serving_config_path(target_dir: str) -> str:
    if os.path.isfile(target_dir):  # a .gguf target: next to the file
        return f"{target_dir}.{SERVING_CONFIG}"
    return os.path.join(target_dir, SERVING_CONFIG)


def load_serving_config(target_dir: str, context: int | None = None) -> dict | None:
    """The calibrated S2D settings of a target dir, or None when it has none. Checked like
    the flags they stand for: with `context` (the positions of the models it will run
    with), gamma must fit it."""
    path = serving_config_path(target_dir)
    if not os.path.isfile(path):
        return None
    text = read_text(path, "serving config")
    rerun = "rerun python -m infer.calibrate"
    try:
        cfg = json.loads(text)  # a JSONDecodeError is a ValueError
        thresholds, gamma, exits = cfg["thresholds"], cfg["gamma"], cfg.get("exits")
        if not _is_count(gamma) or not isinstance(thresholds, list) or not thresholds:
            raise TypeError
    except (KeyError, TypeError, ValueError, AttributeError):
        raise S2DError(f"{path} is not a valid serving config (needs 'thresholds': numbers, "
                       f"'gamma': an integer >= 1, optional 'exits': integers); delete it or "
                       f"{rerun}")
    why = None if exits is None else exits_problem(exits)
    if why:
        raise S2DError(f"{path} is not a valid serving config: its exits {exits!r}: {why}; "
                       f"{rerun}")
    try:  # the rules every flag and call obeys (decode/checks.py)
        th = list(check_thresholds(thresholds, thresholds if exits is None else exits))
        stop = check_stop_threshold(cfg.get("stop_threshold", 0.0))
    except S2DError as e:
        raise S2DError(f"{path}: {e}; {rerun}") from None
    if context is not None and gamma > max_gamma(context):
        raise S2DError(f"{path}: gamma {gamma} does not fit the context of the models "
                       f"({context} positions, max_position_embeddings); rerun python -m "
                       f"infer.calibrate or set gamma <= {max_gamma(context)}")
    for method in SECTIONS:  # the calibrated sections (the lookup rung's), optional
        if method in cfg and not _section_ok(cfg[method], method, context):
            raise S2DError(f"{path}: its {method!r} section is not valid (needs 'gamma': an "
                           f"integer >= 1 that fits the context, 'ngram': [MIN, MAX] with 1 "
                           f"<= MIN <= MAX <= 16, 'lookup_len' in [0, gamma]"
                           f"{', thresholds per exit' if proposer(method).escalates else ''});"
                           f" {rerun}")
    return {**cfg, "thresholds": th, "gamma": gamma, "stop_threshold": stop}


def _section_ok(sec, method: str, context: int | None) -> bool:
    try:
        g = sec["gamma"]
        ok = _is_count(g) and (context is None or g <= max_gamma(context))
        if ok and proposer(method).lookup:
            check_lookup(sec.get("ngram", DEFAULT_NGRAM), sec.get("lookup_len", 0), g)
        if ok and proposer(method).escalates:
            check_thresholds(sec["thresholds"], sec.get("exits") or sec["thresholds"])
            check_stop_threshold(sec.get("stop_threshold", 0.0))
        return ok
    except (KeyError, TypeError, ValueError, S2DError):
        return False


def _is_count(x) -> bool:
    """A positive JSON integer (not a float, string or bool: no silent int() rounding)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def check_writable(target_dir: str) -> str:
    """The serving config's path, once it is known that it can be written there: a
    calibration measures for minutes and writes it last, so a read-only target dir is
    refused before the first measurement (write_atomic needs to create its temp file
    beside it)."""
    path = serving_config_path(target_dir)
    here = os.path.dirname(os.path.abspath(path))
    if not os.access(here, os.W_OK | os.X_OK):
        raise S2DError(f"cannot write the serving config {path}: {here} is not writable; "
                       f"make it writable or copy the target to a writable dir, or measure "
                       f"without writing with --dry-run")
    return path


def write_serving_config(target_dir: str, cfg: dict) -> str:
    """Write atomically (a temp file renamed over it): a reader never sees half a config."""
    path = serving_config_path(target_dir)
    write_atomic(path, json.dumps(cfg, indent=2) + "\n")
    return path


def serving_record(target_dir: str, draft_dir: str, best: dict, paper: dict | None,
                   questions: str, num_prompts: int, max_new_tokens: int) -> dict:
    """The serving config's content. Paths (informational) are relative to the folder
    where the config lives (the target dir, or a .gguf's folder), so a moved or cloned tree
    keeps them right."""
    home = os.path.dirname(os.path.abspath(serving_config_path(target_dir)))

    def rel(path):
        return os.path.relpath(os.path.abspath(path), home)

    return {"draft": rel(draft_dir), "exits": [int(e) for e in best["exits"]],
            "thresholds": best["thresholds"], "gamma": best["gamma"],
            "stop_threshold": float(best.get("stop_threshold", 0.0)),
            "measured_speedup": best.get("measured_speedup"),
            "predicted_speedup": best["predicted_speedup"],
            "paper_thresholds_measured_speedup": None if paper is None
            else paper.get("measured_speedup"),
            "calibrated_on": {"questions": rel(questions), "prompts": num_prompts,
                              "max_new_tokens": max_new_tokens,
                              "utc": datetime.datetime.now(datetime.timezone.utc)
                              .strftime("%Y-%m-%dT%H:%M:%SZ")}}


def slower_than_ar_note(cfg: dict, target: str) -> str | None:
    """A one-line note when the calibration found even its best setting slower than AR
    (speculation does not pay on the machine it ran on), else None. Only where that
    machine is this one: a calibration that names another machine (`calibrated_on`'s
    `machine`, without this machine's `machine_key`: compile_cache.machine_key) says
    nothing about this one (the shipped SmolLM2 setting measured 0.91x of AR on a Zen 3
    without the CPU kernels, while S2D runs 1.3x AR on the README's Zen 4)."""
    measured = cfg.get("measured_speedup")
    if not isinstance(measured, (int, float)) or measured >= 1.0:
        return None
    where = cfg.get("calibrated_on") if isinstance(cfg.get("calibrated_on"), dict) else {}
    from s2d_jax.compile_cache import machine_key
    if "machine" in where and where.get("machine_key") != machine_key():
        return None
    return (f"note: {target}'s calibrated S2D setting measured {measured:.2f}x of AR where "
            f"it was calibrated ({serving_config_path(target)}); --method ar may be faster "
            f"there")


def paper_thresholds(num_exits: int) -> tuple[float, ...]:
    """The paper's thresholds: 0.5 at every exit but the last, which always drafts (0)."""
    return (PAPER_THRESHOLD,) * (num_exits - 1) + (0.0,)


@dataclasses.dataclass(frozen=True)
class DecodeSetting:
    """THE decode setting of a method on a target, built by `resolve` (which works out the
    defaults) and checked here, once, by the table's rules (decode/methods.py); Decoder,
    the bench, calibration, the API, the CLIs and AOT take it as it is.

    exits: () for a method without exits (ar, lookup); thresholds: one per exit (None
    without exits); gamma: draft tokens per round (0 for ar, which drafts none);
    stop_threshold: the dynamic draft length's stop (0 = always gamma tokens); ngram,
    lookup_len: the lookup rung's n range and most tokens (0 = gamma); calibrated: it came
    from s2d_serving.json; note: a line for the user (the calibration was not used, or it
    measured slower than AR)."""
    method: str
    exits: tuple[int, ...]
    thresholds: tuple[float, ...] | None
    gamma: int
    stop_threshold: float = 0.0
    calibrated: bool = False
    note: str | None = None
    ngram: tuple[int, int] = DEFAULT_NGRAM
    lookup_len: int = 0

    def __post_init__(self):
        row = proposer(self.method)
        put = functools.partial(object.__setattr__, self)
        exits = tuple(validate.integers_list(self.exits, "exits", 1) if self.exits else ())
        if not row.exits and exits:
            raise S2DError(f"method {self.method} drafts with no exits; drop exits {exits}")
        if row.exits:
            why = exits_problem(exits)
            if why:
                raise S2DError(f"exits must be increasing positive layer counts, got "
                               f"{list(exits)}: {why}")
            if row.single_exit and len(exits) != 1:
                raise S2DError(f"method {self.method} uses exactly one exit (--exit), got "
                               f"{list(exits)}")
        put("exits", exits)
        put("thresholds", check_thresholds(self.thresholds, exits) if row.exits else None)
        # a method that drafts nothing has no draft length (a given one is not used)
        put("gamma", validate.integer(self.gamma, "gamma", 1) if row.proposes else 0)
        put("stop_threshold", check_stop_threshold(self.stop_threshold))
        ngram, lookup_len = check_lookup(self.ngram, self.lookup_len, self.gamma)
        put("ngram", ngram)
        put("lookup_len", lookup_len)

    @property
    def proposer(self):
        """The method's row of the table (decode/methods.py)."""
        return proposer(self.method)


def calibrated_exits(served: dict, draft_exits: Sequence[int]) -> tuple[int, ...]:
    """The exits a serving config was calibrated for (its 'exits', else the draft's)."""
    return tuple(int(e) for e in served.get("exits") or draft_exits)


def calibration_fits(served: dict, draft_exits: Sequence[int]) -> bool:
    """THE rule for whether a calibrated setting fits a draft: its exits are a subset of the
    draft's exits, with one threshold per exit. A subset, not equality: calibration may
    settle on fewer exits (SmolLM2's draft has exits 2 and 4 and is calibrated to exit 2
    alone), and every exit of the subset is one the draft was trained to exit at; an exit
    the draft lacks would draft from an untrained head, so such a file belongs to another
    draft and is not used (a note says so)."""
    exits = calibrated_exits(served, draft_exits)
    return len(served["thresholds"]) == len(exits) and set(exits) <= set(draft_exits)


def resolve(method: str, draft_exits: Sequence[int] = (), served: dict | None = None, *,
            exits: Sequence[int] | None = None, exit: int | None = None,
            thresholds: Sequence[float] | None = None, gamma: int | None = None,
            stop_threshold: float | None = None, draft_layers: int | None = None,
            ngram: Sequence[int] | None = None, lookup_len: int | None = None,
            target: str = "the target") -> DecodeSetting:
    """The decode setting of `method` on a target, the one place its defaults are worked
    out: draft_exits are the draft's (`s2d_exits`, defaults.draft_exits), draft_layers its
    depth (a single-exit method's default exit), served the target's load_serving_config
    (read by the calibrated methods, the table's serving_section), the keywords the
    caller's overrides (None: not given), target its path (for notes).

    Exits: none for a method without exits; one (`exit`, or `exits` of one) for a
    single-exit method, by default the draft's depth; else the calibrated ones when the
    calibration fits the draft (calibration_fits), else the draft's. Thresholds, gamma, the
    stop and the lookup's n range and length are the calibrated ones when nothing given
    contradicts the calibration (its exits, thresholds and gamma); otherwise thresholds are
    the paper's, gamma DEFAULT_GAMMA, the stop 0, the n range DEFAULT_NGRAM and the lookup
    length gamma."""
    row = proposer(method)
    cal, note = _calibrated(row, draft_exits, served, target)
    if row.single_exit:
        if exit is None and exits:
            exit = exits[0] if len(exits) == 1 else None
            if exit is None:
                raise S2DError(f"method {method} uses exactly one exit (--exit), got "
                               f"{list(exits)}")
        if exit is None and row.self_draft:
            raise S2DError(f"method {method} needs exit=N (--exit): how many target layers "
                           f"draft")
        exits = (int(exit or draft_layers or max(draft_exits or (0,))),)
    elif row.exits:
        cal_exits = calibrated_exits(cal, draft_exits) if cal is not None else None
        exits = tuple(int(e) for e in (exits or cal_exits or draft_exits))
        if cal is not None and row.escalates and (thresholds is not None
                                                   or exits != cal_exits):
            cal = None  # other exits or thresholds: the calibration does not apply
    else:
        exits = ()
    if cal is not None and row.lookup and gamma is not None and gamma != cal["gamma"]:
        cal = None  # another gamma: the calibrated lookup length may not fit it
    if cal is not None and row.serving_section == "":
        note = slower_than_ar_note(cal, target)
    use = cal or {}
    if thresholds is None and row.exits:
        thresholds = use.get("thresholds") or paper_thresholds(len(exits))
    return DecodeSetting(
        method, exits, thresholds,
        gamma if gamma is not None else use.get("gamma", row.default_gamma),
        stop_threshold if stop_threshold is not None else use.get("stop_threshold", 0.0),
        cal is not None, note,
        tuple(ngram if ngram is not None else use.get("ngram", DEFAULT_NGRAM)),
        lookup_len if lookup_len is not None else use.get("lookup_len", 0))


def _calibrated(row, draft_exits, served, target) -> tuple[dict | None, str | None]:
    """(the calibrated setting of a method in `served`, or None; a note when it exists but
    does not fit the draft): the top-level fields ("" section) or its named section."""
    if served is None or row.serving_section is None:
        return None, None
    cal = served if row.serving_section == "" else served.get(row.serving_section)
    if cal is None or not row.exits or calibration_fits(cal, draft_exits):
        return cal, None
    where = "" if row.serving_section == "" else f" {row.serving_section!r}"
    return None, (f"note: {target}'s calibrated{where} setting (exits "
                  f"{list(calibrated_exits(cal, draft_exits))}, {len(cal['thresholds'])} "
                  f"thresholds) does not fit the draft's exits {list(draft_exits)} and is "
                  f"not used; recalibrate for this draft: python -m infer.calibrate")


def target_setting(method: str, target: str, target_cfg, draft_cfg=None, draft_extra=None,
                   **overrides) -> DecodeSetting:
    """resolve() for a loaded target (its path, for its s2d_serving.json) and draft (its
    config and extra settings, for its exits): what the API, infer.generate and infer.bench
    decode a target with. The calibrated gamma must fit both models' context."""
    from s2d_jax.decode.defaults import draft_exits

    exits = draft_exits(draft_extra, draft_cfg) if draft_cfg is not None else ()
    served = None
    if proposer(method).calibrated:
        served = load_serving_config(target, min(c.max_position_embeddings
                                                 for c in (target_cfg, draft_cfg)
                                                 if c is not None))
    return resolve(method, exits, served, target=target,
                   draft_layers=None if draft_cfg is None else draft_cfg.num_layers,
                   **overrides)
