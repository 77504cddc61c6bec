"""`method="auto"` (--method auto: the default of generate, chat, serve and the API): decode
with the method a target's calibration chose among those it ranked side by side (the
fastest, or a simpler one it contains that it does not beat: the "default" section of its
s2d_serving.json, written by calibration/method_ranking.py), with the setting it measured;
where the target has no ranking, S2D (its calibrated top-level setting where it has one,
else the paper's 0.5/.../0 at gamma 4: serving_config.resolve).

The section: {"method": the winner, "ranking": [{"label", "method", "setting": {exits,
thresholds, gamma, stop_threshold, ngram, lookup_len}, "measured_speedup"}, ...] in order
of preference (the winner, then the fastest first), plus informational fields}. Without
a draft, auto takes the first ranked method that needs none (the ranking keeps them all).

No JAX here: the CLIs choose the method (does it need a draft?) before JAX starts.
"""

from __future__ import annotations

import dataclasses

from s2d_jax.decode.methods import METHODS, methods_where, proposer
from s2d_jax.errors import S2DError

SECTION = "default"  # its key in s2d_serving.json
SETTING_FIELDS = ("exits", "thresholds", "gamma", "stop_threshold", "ngram", "lookup_len")
# where a target has no ranking: the paper's method (the sorted draft, escalating)
FALLBACK = methods_where(escalates=True, lookup=False)[0]


@dataclasses.dataclass(frozen=True)
class Choice:
    method: str  # a row of the table
    stored: dict | None  # the ranked setting (SETTING_FIELDS); None: resolve's defaults
    note: str | None = None  # a line for the user (why not the ranking's winner)


def ranking(served: dict | None, where: str = "the serving config") -> list[dict]:
    """The ranked rows of a loaded serving config, preferred first ([] without a ranking);
    a malformed section is a user error naming the fix."""
    sec = (served or {}).get(SECTION)
    if sec is None:
        return []
    try:
        rows = list(sec["ranking"])
        ok = rows and all(r["method"] in METHODS and isinstance(r["setting"], dict)
                          and isinstance(r["measured_speedup"], (int, float)) for r in rows)
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise S2DError(f"{where}: its {SECTION!r} section is not valid (needs 'ranking': "
                       f"rows with 'method', 'setting' and 'measured_speedup'); rerun python "
                       f"-m infer.calibrate_lookup, or delete the section")
    return rows  # in the calibration's order of preference (method_ranking.pick first)


def choose(served: dict | None, has_draft: bool, where: str = "the serving config") -> Choice:
    """What auto decodes with on a target whose load_serving_config is `served`."""
    rows = ranking(served, where)
    if not rows:
        return Choice(FALLBACK, None)
    usable = [r for r in rows if has_draft or not proposer(r["method"]).needs_draft]
    if not usable:
        return Choice(FALLBACK, None)
    top = usable[0]
    note = None
    if top is not rows[0]:
        note = (f"note: auto: the calibrated choice {rows[0]['label']} needs a draft; "
                f"decoding with {top['label']}, the first ranked without one (pass --draft "
                f"for {rows[0]['label']})")
    return Choice(top["method"], {k: top["setting"][k] for k in SETTING_FIELDS
                                  if k in top["setting"]}, note)


def target_choice(target: str, has_draft: bool) -> Choice:
    """choose() for a target path (its s2d_serving.json, if any), before any model loads."""
    from s2d_jax.decode.serving_config import load_serving_config, serving_config_path
    return choose(load_serving_config(target), has_draft, serving_config_path(target))


def auto_setting(choice: Choice, draft_exits, served: dict | None, *, target: str,
                 draft_layers: int | None = None, **overrides):
    """The DecodeSetting of `choice` on a loaded target: the ranked setting as measured;
    with settings given (gamma, exits, ...), the chosen method with them, as if named
    (serving_config.resolve); a ranked setting whose exits the draft lacks falls back to
    FALLBACK with a note."""
    from s2d_jax.decode.serving_config import resolve

    given = any(v is not None for v in overrides.values())
    st, note = choice.stored, choice.note
    if st is not None and st.get("exits") and not set(st["exits"]) <= set(draft_exits):
        note = (f"note: auto: {target}'s calibrated choice ({choice.method}, exits "
                f"{list(st['exits'])}) does not fit the draft's exits {list(draft_exits)}; "
                f"decoding with {FALLBACK}; recalibrate for this draft: python -m "
                f"infer.calibrate_lookup")
        choice, st = Choice(FALLBACK, None), None
    if st is None or given:
        s = resolve(choice.method, draft_exits, served, target=target,
                    draft_layers=draft_layers, **overrides)
        return dataclasses.replace(s, note=note or s.note)
    exits = st.get("exits") if proposer(choice.method).exits else None
    s = resolve(choice.method, draft_exits, None, target=target, draft_layers=draft_layers,
                exits=exits or None, thresholds=st.get("thresholds"), gamma=st.get("gamma"),
                stop_threshold=st.get("stop_threshold"), ngram=st.get("ngram"),
                lookup_len=st.get("lookup_len"))
    return dataclasses.replace(s, calibrated=True, note=note)


def auto_target_setting(target: str, target_cfg, draft_cfg=None, draft_extra=None,
                        **overrides):
    """serving_config.target_setting for `method` AUTO: the setting auto decodes a loaded
    target (and draft) with."""
    from s2d_jax.decode.defaults import draft_exits
    from s2d_jax.decode.serving_config import load_serving_config, serving_config_path
    served = load_serving_config(target, min(c.max_position_embeddings
                                             for c in (target_cfg, draft_cfg) if c is not None))
    choice = choose(served, draft_cfg is not None, serving_config_path(target))
    return auto_setting(choice, draft_exits(draft_extra, draft_cfg) if draft_cfg is not None
                        else (), served, target=target,
                        draft_layers=None if draft_cfg is None else draft_cfg.num_layers,
                        **overrides)


def cli_choice(method: str, targets, has_draft: bool) -> tuple[str, str, str | None]:
    """A command's --method over its target paths -> (what to pass to target_setting: AUTO
    or the named method, the row it decodes with, a note where the targets disagree),
    checked before any model loads. Several targets share one engine, so one method: where their rankings
    chose differently, FALLBACK for all (a note says so)."""
    from s2d_jax.decode.methods import is_auto
    if not is_auto(method):
        return method, method, None
    found = [target_choice(t, has_draft) for t in targets]
    rows = {c.method for c in found}
    if len(rows) > 1:
        return FALLBACK, FALLBACK, (f"note: auto: the targets' calibrations chose different "
                                    f"methods ({', '.join(sorted(rows))}) and one engine "
                                    f"decodes one; decoding with {FALLBACK} (name one with "
                                    f"--method)")
    chosen = found[0]
    if proposer(chosen.method).needs_draft and not has_draft:
        raise S2DError(f"--method auto decodes with {chosen.method} here (no calibrated choice "
                       f"in the target's s2d_serving.json: python -m infer.calibrate_lookup "
                       f"ranks the methods), which needs --draft PATH; pass one, or use "
                       f"--method lookup or ar")
    return method, chosen.method, None  # its own note comes with the target's setting
