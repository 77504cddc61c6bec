"""infer.tpu_fits without the TPU compiler: the table is rendered from the rows its --state
keeps (records and each row's HLO), so a rerun after an interruption compiles nothing that
finished; the walk's round times and Lemma 3.1's columns come from the kept HLO."""

import gzip
import json
import re

import pytest

from infer import tpu_fits
from s2d_jax.decode.roofline import expected_tokens
from s2d_jax.decode.tpu_fits import row_key


def _round_hlo(matmuls: int, n: int = 512) -> str:
    """A round loop of `matmuls` [1, n] x [n, n] bf16 products (3 rounds)."""
    dots = "\n".join(f"  %d{k} = bf16[1,{n}]{{1,0}} dot(%x, %w), lhs_contracting_dims={{1}}, "
                     f"rhs_contracting_dims={{0}}" for k in range(matmuls))
    carry = f"(s32[], bf16[{n},{n}], bf16[1,{n}])"
    typed = f"(s32[], bf16[{n},{n}]{{1,0}}, bf16[1,{n}]{{1,0}})"
    return f"""HloModule round

%body (c: {carry}) -> {carry} {{
  %c = {typed} parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %w = bf16[{n},{n}]{{1,0}} get-tuple-element(%c), index=1
  %x = bf16[1,{n}]{{1,0}} get-tuple-element(%c), index=2
{dots}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = {typed} tuple(%next, %w, %d0)
}}

%cond (k: {carry}) -> pred[] {{
  %k = {typed} parameter(0)
  %n = s32[] get-tuple-element(%k), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%n, %limit), direction=LT
}}

ENTRY %main (e: {carry}) -> {carry} {{
  %e = {typed} parameter(0)
  ROOT %loop = {typed} while(%e), condition=%cond, body=%body
}}
"""


def _record(method, hlo_matmuls, state, refused=False):
    key = row_key("v5e:2x2", "vicuna-7b", method, 1, 4096)
    rec = {"key": key, "chip": "v5e", "topology": "v5e:2x2", "target": "vicuna-7b",
           "method": method, "batch": 1, "context": 4096, "gamma": 4, "exits": [],
           "minimum": [2**20, 2**20], "bandwidth": 819e9, "limit": 16 * 2**30,
           "cache_shapes": []}
    if refused:
        return {**rec, "refusal": "RESOURCE_EXHAUSTED: needs 17 GB of 15.75"}
    name = re.sub(r"[^\w.-]+", "_", key) + ".hlo.gz"
    (state / name).write_bytes(gzip.compress(_round_hlo(hlo_matmuls).encode()))
    return {**rec, "argument": 3 * 2**30, "temp": 2**30, "peak": 4 * 2**30, "compile_s": 1.0}


def test_kept_rows_render_without_compiling(tmp_path):
    state = tmp_path / "fits.rows"
    state.mkdir()
    rows = {r["key"]: r for r in (_record("ar", 1, state), _record("sd", 2, state),
                                  _record("s2d", 0, state, refused=True))}
    (state / "rows.json").write_text(json.dumps(rows))
    out = tmp_path / "fits.md"
    # every row kept: no compile (this environment has no libtpu to compile with)
    assert tpu_fits.main(["--out-file", str(out), "--models", "vicuna-7b", "--chips", "v5e",
                          "--batch-sizes", "1", "--acceptance", "0.25",
                          "--paper-acceptance", "0.6"]) == 0
    lines = out.read_text().splitlines()
    assert "Lemma 3.1 speedup at acceptance 0.25" in lines[0]
    assert "Lemma 3.1 speedup at paper's 0.6" in lines[0]
    ar, sd, s2d = (line.split("|")[1:-1] for line in lines[2:])
    walk = 1e3 * (512 * 512 * 2 + 2 * 512 * 2) / 819e9  # a weight read, x in, result out
    assert float(ar[8]) == pytest.approx(walk, abs=0.01)
    # SD's round reads the weight twice: Lemma 3.1 at a = 0.25, gamma 4
    expect = expected_tokens(0.25, 4) * (512 * 512 + 1024) / (2 * 512 * 512 + 2048)
    assert float(sd[9].strip().rstrip("x")) == pytest.approx(expect, abs=0.01)
    assert float(sd[10].strip().rstrip("x")) == pytest.approx(
        expect / expected_tokens(0.25, 4) * expected_tokens(0.6, 4), abs=0.01)
    assert "NO (compiler: RESOURCE_EXHAUSTED" in s2d[6] and s2d[8].strip() == "-"


def test_a_paper_column_without_the_paper_figure_says_so(tmp_path):
    state = tmp_path / "t.rows"
    state.mkdir()
    rows = {r["key"]: r for r in (_record("ar", 1, state), _record("sd", 2, state))}
    (state / "rows.json").write_text(json.dumps(rows))
    assert tpu_fits.main(["--out-file", str(tmp_path / "t.md"), "--models", "vicuna-7b",
                          "--chips", "v5e", "--methods", "ar,sd", "--batch-sizes", "1"]) == 0
    sd = (tmp_path / "t.md").read_text().splitlines()[3].split("|")[1:-1]
    assert sd[-1].strip() == "n/a"
    # --kept-only: the rows kept so far (the whole default grid asked, two rows kept)
    assert tpu_fits.main(["--out-file", str(tmp_path / "k.md"), "--state", str(state),
                          "--kept-only"]) == 0
    assert len((tmp_path / "k.md").read_text().splitlines()) == 2 + 2


def test_bad_state_and_rates_are_one_line_errors(tmp_path, capsys):
    state = tmp_path / "fits.rows"
    state.mkdir()
    (state / "rows.json").write_text("{not json")
    with pytest.raises(SystemExit) as e:
        tpu_fits.main(["--out-file", str(tmp_path / "fits.md")])
    assert e.value.code != 0
    assert "rows.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        tpu_fits.main(["--out-file", str(tmp_path / "x.md"), "--paper-acceptance", "1.5"])
    assert e.value.code != 0 and "rates in [0, 1)" in capsys.readouterr().err
