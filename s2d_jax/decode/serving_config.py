"""A target's calibrated S2D settings: DIR/s2d_serving.json (written by infer.calibrate,
read by infer.generate and infer.bench).

Schema: {"thresholds": [per exit, in [0, 1], the last usually 0], "gamma": >= 1,
"stop_threshold": in [0, 1] (0 = always gamma draft tokens; optional), "exits": [layer
counts] (optional: default the draft's), plus informational fields (`serving_record`):
the draft dir, the measured and predicted speedups and what it was calibrated on.
"""

from __future__ import annotations

import datetime
import json
import os

from s2d_jax.decode.defaults import max_gamma
from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import write_atomic
from s2d_jax.readers import read_text

SERVING_CONFIG = "s2d_serving.json"


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
    try:
        cfg = json.loads(text)  # a JSONDecodeError is a ValueError
        th = [float(t) for t in cfg["thresholds"]]
        gamma, exits = cfg["gamma"], cfg.get("exits")
        stop = float(cfg.get("stop_threshold", 0.0))
        if not _is_count(gamma) or not (exits is None or isinstance(exits, list) and
                                        all(_is_count(e) for e in exits)):
            raise TypeError
    except (KeyError, TypeError, ValueError, AttributeError):
        raise S2DError(f"{path} is not a valid serving config (needs 'thresholds': numbers, "
                       f"'gamma': an integer >= 1, optional 'exits': integers); delete it or "
                       f"rerun python -m infer.calibrate")
    if (not th or any(not 0.0 <= t <= 1.0 for t in th) or gamma < 1
            or not 0.0 <= stop <= 1.0):
        raise S2DError(f"{path} has thresholds or stop_threshold outside [0, 1] or gamma < 1; "
                       f"rerun python -m infer.calibrate")
    if exits and any(a >= b for a, b in zip(exits, exits[1:])):
        raise S2DError(f"{path}: exits {exits} are not ascending layer counts; rerun python "
                       f"-m infer.calibrate")
    if context is not None and gamma > max_gamma(context):
        raise S2DError(f"{path}: gamma {gamma} does not fit the context of the models "
                       f"({context} positions, max_position_embeddings); rerun python -m "
                       f"infer.calibrate or set gamma <= {max_gamma(context)}")
    return {**cfg, "thresholds": th, "gamma": gamma, "stop_threshold": stop}


def _is_count(x) -> bool:
    """A positive JSON integer (not a float, string or bool: no silent int() rounding)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def write_serving_config(target_dir: str, cfg: dict) -> str:
    """Write atomically (a temp file renamed over it): a reader never sees half a config."""
    path = serving_config_path(target_dir)
    write_atomic(path, json.dumps(cfg, indent=2) + "\n")
    return path


def serving_record(target_dir: str, draft_dir: str, best: dict, paper: dict | None,
                   questions: str, num_prompts: int, max_new_tokens: int) -> dict:
    """The serving config's content. Paths (informational) are relative to the target dir,
    where the config lives, so a moved or cloned tree keeps them right."""
    def rel(path):
        return os.path.relpath(os.path.abspath(path), os.path.abspath(target_dir))

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
    (speculation does not pay on the machine it ran on), else None."""
    measured = cfg.get("measured_speedup")
    if not isinstance(measured, (int, float)) or measured >= 1.0:
        return None
    return (f"note: {target}'s calibrated S2D setting measured {measured:.2f}x of AR where "
            f"it was calibrated ({serving_config_path(target)}); --method ar may be faster "
            f"there")
