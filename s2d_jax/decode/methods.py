"""The one table of decoding methods (proposers): what each proposes with, what it needs and
its defaults. Every other module asks this table (`proposer(method).needs_draft`, ...)
instead of comparing method names; adding a proposer is one row here (tests/test_methods.py
checks that no module outside this one compares method names).

No JAX here: the CLIs list the methods before JAX starts.
"""

from __future__ import annotations

import dataclasses

from s2d_jax.errors import S2DError

DEFAULT_GAMMA = 4  # the paper's draft length, for a method without a calibrated one
PAPER_THRESHOLD = 0.5  # the paper's confidence threshold at every exit but the last (0)
DEFAULT_NGRAM = (1, 3)  # the lookup's n range: match the last 1 to 3 tokens (PLD's, vLLM's)


@dataclasses.dataclass(frozen=True)
class Proposer:
    """One decoding method.

    proposes: it drafts tokens for the target to verify (all but AR).
    needs_draft: it drafts with a separate draft model (--draft / draft=PATH).
    exits: it drafts with exits of a model (a draft, or the target's own first layers).
    single_exit: exactly one exit (--exit), no escalation (vanilla SD, self-drafting).
    self_draft: the exit is the target's own first layers (its draft is the target).
    lookup: its lowest rung copies tokens from the context (decode/lookup.py).
    serving_section: where its calibrated setting lives in s2d_serving.json: "" the file's
      top-level fields, a name its section of that name, None not calibrated.
    """

    name: str
    summary: str
    proposes: bool = True
    needs_draft: bool = False
    exits: bool = False
    single_exit: bool = False
    self_draft: bool = False
    lookup: bool = False
    serving_section: str | None = None

    @property
    def escalates(self) -> bool:
        """It climbs a ladder of exits by confidence thresholds (one per exit)."""
        return self.exits and not self.single_exit

    @property
    def calibrated(self) -> bool:
        """infer.calibrate writes a setting for it that its decodes read by default."""
        return self.serving_section is not None

    @property
    def default_gamma(self) -> int:
        """Draft tokens per round without a calibrated or given one (0: it drafts none)."""
        return DEFAULT_GAMMA if self.proposes else 0


TABLE = {p.name: p for p in (
    Proposer("ar", "the target alone, one token per forward", proposes=False),
    Proposer("sd", "the draft cut at one exit (--exit, default its depth)", needs_draft=True,
             exits=True, single_exit=True),
    Proposer("self", "the target's own first --exit layers", exits=True, single_exit=True,
             self_draft=True),
    Proposer("s2d", "the sorted draft, escalating over its exits by confidence",
             needs_draft=True, exits=True, serving_section=""),
    Proposer("lookup", "tokens copied from the context (prompt lookup), no draft model",
             lookup=True, serving_section="lookup"),
    Proposer("ladder", "the lookup first, then the sorted draft's exits (S2D's ladder)",
             needs_draft=True, exits=True, lookup=True, serving_section="ladder"),
)}
METHODS = tuple(TABLE)
CALIBRATED = "-cal"  # a bench run's label suffix for a method's calibrated setting (s2d-cal)
LOOKUP_RUNG = "lookup"  # the lookup rung's key in a generation's accepted_by_rung statistics
BASELINE = next(p.name for p in TABLE.values() if not p.proposes)  # what speedups are over
# Not a row: the method a target's calibration chose among the rows it ran side by side (its
# s2d_serving.json "default", decode/auto_method.py), S2D where it has none
AUTO = "auto"
CHOICES = (AUTO,) + METHODS  # what --method and the API's `method` accept


def is_auto(method) -> bool:
    """Whether `method` asks for the calibrated choice (AUTO) rather than a row."""
    return method == AUTO


def proposer(method: str) -> Proposer:
    """The table's row of `method`; an unknown name is a user error."""
    row = TABLE.get(method) if isinstance(method, str) else None
    if row is None:
        raise S2DError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    return row


def methods_where(**wanted) -> tuple[str, ...]:
    """The methods whose named properties have the wanted values, in table order
    (e.g. methods_where(lookup=True) -> ("lookup", "ladder"))."""
    return tuple(m for m, p in TABLE.items()
                 if all(getattr(p, k) == v for k, v in wanted.items()))


def method_order(method: str) -> int:
    """A method's place in the table (for reports that list methods in it)."""
    return METHODS.index(proposer(method).name)


def has(method: str, **wanted) -> bool:
    """Whether `method` is a row of the table with the wanted property values (False for a
    name outside it, e.g. a bench report's chain entry)."""
    row = TABLE.get(method)
    return row is not None and all(getattr(row, k) == v for k, v in wanted.items())


# the paper's comparison: AR, SD (one exit of the draft), S2D (its exits, escalating)
PAPER_METHODS = (BASELINE,) + methods_where(needs_draft=True, lookup=False)
