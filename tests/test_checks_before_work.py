"""Issue 68, "every request, every file": every check before any work, nothing written by a
run that fails its checks, and every error naming a fix that exists. The CLI cases follow
tests/test_cli_fuzz.py's rule (exit 2, one `error:` line with both keywords, no traceback,
the workspace byte-identical, no new file) on its workspace; the rest need a stub (a
missing compiler, a read-only dir) or call the API."""

from __future__ import annotations

import ast
import glob
import importlib
import importlib.util
import os
import re
import types

import pytest

import s2d_jax
from s2d_jax.errors import S2DError
from test_cli_fuzz import C, DEMO, REPO, check_one_error, snapshot, ws  # noqa: F401 (fixture)

T, D = os.path.join(DEMO, "target-s"), os.path.join(DEMO, "draft")
# train.smollm2_draft on the demo target, every output inside the workspace
SMOL = ["--target", T, "--work", "{ws}/smol", "--out", "{ws}/smol_pack", "--train-exits", "2,4",
        "--distill-batches", "1", "--max-new-tokens", "2", "--skip-calibration",
        "--head-vocab", "0"]
CASES = [
    # checked against the target before --work, its marker and the run plan are written
    C("smol-init-from-other-shape", "train.smollm2_draft",
      SMOL + ["--init-from", f"{REPO}/models/smollm2-draft"], "--init-from", "another shape"),
    C("smol-frozen-layers-no-exits", "train.smollm2_draft",
      SMOL + ["--train-exits", "", "--init-from", D, "--frozen-layers", "1"],
      "--train-exits ''", "integers >= 1"),  # was an IndexError
    C("smol-head-vocab-beyond-vocab", "train.smollm2_draft", SMOL + ["--head-vocab", "4096"],
      "--head-vocab 4096", "use at most 2048"),  # was refused after writing head_vocab.json
    # a missing model is named as such, with the fix (was: "tokenizer directory ...")
    C("gen-target-missing", "infer.generate",
      ["--target", "{ws}/nope", "--method", "ar", "--prompt", "hi"],
      "--target", "pass an HF model dir"),
    C("sbench-target-missing", "infer.serve_bench",
      ["--target", "{ws}/nope", "--methods", "ar", "--out", "{ws}/sb"],
      "--target", "pass an HF model dir"),
    C("cal-target-missing", "infer.calibrate", ["--target", "{ws}/nope", "--draft", D],
      "--target", "pass an HF model dir"),
    C("calk-target-missing", "infer.calibrate_lookup", ["--target", "{ws}/nope", "--draft", D],
      "--target", "pass an HF model dir"),
]


def _refused(module, argv, root, keywords, capsys) -> str:
    before, cwd = snapshot(root), sorted(os.listdir("."))
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main([str(a).replace("{ws}", str(root)) for a in argv])
    err = check_one_error(e.value.code, capsys.readouterr().err, keywords)
    assert snapshot(root) == before  # nothing written, nothing half-made
    assert sorted(os.listdir(".")) == cwd
    return err


@pytest.mark.parametrize("cli, argv, keywords", CASES)
def test_bad_input_is_refused_before_any_work(ws, capsys, cli, argv, keywords):  # noqa: F811
    _refused(cli, argv, ws, keywords, capsys)


# --- compilers that are not installed ---------------------------------------------------

@pytest.fixture
def no_compilers(monkeypatch):
    """Neither libtpu nor JAX's CUDA plugin, whatever this machine has: find_spec of a
    dotted name whose parent package is missing raises, as it does without jax_plugins."""
    for var in ("S2D_LIBTPU_PATH", "TPU_LIBRARY_PATH"):
        monkeypatch.delenv(var, raising=False)
    real = importlib.util.find_spec

    def find_spec(name, *a, **kw):
        if name.startswith("jax_plugins"):
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return None if name == "libtpu" else real(name, *a, **kw)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("module, argv", [
    ("infer.aot", ["--target-config", f"{REPO}/configs/models/vicuna-7b-v1.5.yaml",
                   "--method", "ar", "--topology", "h100:8"]),
    ("train.aot", ["--config", f"{REPO}/configs/train/cpu_soft.yaml", "--topology", "h100:2"]),
])
def test_an_h100_topology_without_the_cuda_plugin_names_what_to_install(
        tmp_path, capsys, monkeypatch, no_compilers, module, argv):
    monkeypatch.chdir(tmp_path)  # was a ModuleNotFoundError traceback
    _refused(module, argv, tmp_path, ["CUDA plugin", "pip install -e '.[cuda]'"], capsys)


FITS = ["--out-file", "{ws}/fits.md", "--models", "vicuna-7b", "--chips", "v5e",
        "--methods", "ar", "--batch-sizes", "1"]


def test_tpu_fits_without_libtpu_leaves_no_state_dir(tmp_path, capsys, no_compilers):
    _refused("infer.tpu_fits", FITS, tmp_path, ["needs the TPU compiler",
                                                "pip install -e '.[tpu]'"], capsys)
    assert not os.path.exists(tmp_path / "fits.rows")  # was left behind, empty


@pytest.mark.parametrize("rows", ["[]", '"rows"', '{"k": 1}', '{"k": {"key": "other"}}'])
def test_tpu_fits_refuses_a_rows_file_of_another_shape(tmp_path, capsys, no_compilers, rows):
    (tmp_path / "fits.rows").mkdir()
    (tmp_path / "fits.rows" / "rows.json").write_text(rows)  # was read as "no rows yet"
    _refused("infer.tpu_fits", FITS, tmp_path, ["is not a JSON object of rows",
                                                "move it away"], capsys)


# --- a result that cannot be written: refused before the measuring ----------------------

def test_calibrate_lookup_checks_its_output_before_measuring(tmp_path, capsys, monkeypatch):
    from test_cli_fuzz import _model_copy
    target = _model_copy(tmp_path, "T", T)  # holds s2d_serving.json, as calibrate wrote it
    real = os.access

    def access(path, mode, *a, **kw):  # a read-only mount (root passes chmod)
        if os.path.abspath(path) == str(target) and mode & os.W_OK:
            return False
        return real(path, mode, *a, **kw)
    monkeypatch.setattr(os, "access", access)
    import s2d_jax.calibration.lookup_calibration as lookup
    monkeypatch.setattr(lookup, "calibrate_lookup", lambda *a, **kw: pytest.fail(
        "measured before checking that the result can be written"))
    _refused("infer.calibrate_lookup", ["--target", target, "--draft", D], tmp_path,
             ["cannot write the serving config", "--dry-run"], capsys)


# --- the API and the files it reads -----------------------------------------------------

def test_a_model_whose_json_files_start_with_a_byte_order_mark_loads(tmp_path):
    """The docs say a BOM is ignored: transformers refused the tokenizer's config.json."""
    from test_cli_fuzz import _model_copy
    bom = _model_copy(tmp_path, "bom", T)
    for f in glob.glob(str(bom / "*.json")):
        data = open(f, "rb").read()
        open(f, "wb").write(b"\xef\xbb\xbf" + data)
    before = snapshot(bom)
    assert s2d_jax.load_tokenizer(str(bom)).encode("Hello there") == \
        s2d_jax.load_tokenizer(T).encode("Hello there")
    assert s2d_jax.load_model(str(bom))[0] == s2d_jax.load_model(T)[0]
    assert snapshot(bom) == before  # the user's files keep their marks


@pytest.mark.parametrize("stop", [5, {"a": 1}])
def test_a_wrong_stop_shows_a_stop_example(stop):
    """Not an optimizer override (the example of the other list of strings)."""
    with pytest.raises(S2DError, match="stop") as e:
        s2d_jax.generate("Hi", T, method="ar", stop=stop, max_new_tokens=2)
    assert "optimizer" not in str(e.value)


def test_a_cut_scaling_study_points_file_is_one_error_line(tmp_path):
    from s2d_jax.bench.study import read_jsonl
    (tmp_path / "points.jsonl").write_text('{"shape": "2 layers", "kind": "on_pol')
    with pytest.raises(S2DError, match=r"points.jsonl:1 is not valid JSON"):
        read_jsonl(str(tmp_path / "points.jsonl"), "points file")  # was JSONDecodeError


# --- error messages name flags their command has -----------------------------------------

def test_serve_bench_says_its_own_slot_flag():
    from s2d_jax.bench import serve_load
    server = types.SimpleNamespace(engine=types.SimpleNamespace(max_len=8), stop=lambda: None)
    with pytest.raises(S2DError) as e:
        serve_load.run_methods(lambda method: server, ["ar"], [[1] * 10], [1], 1, 4)
    assert "--slot-len" in str(e.value) and "--max-len" not in str(e.value)


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")


def _text(node) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join("{}" if isinstance(v, ast.FormattedValue) else _text(v)
                       for v in node.values)
    return _text(node.left) + _text(node.right) if isinstance(node, ast.BinOp) else ""


def _messages(module: str):
    """(line, text) of every S2DError(...) / parser .error(...) message in `module`."""
    tree = ast.parse(open(module.replace(".", "/") + ".py").read())
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args:
            f = n.func
            if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")) in ("S2DError",
                                                                                "error"):
                yield n.lineno, "".join(_text(a) for a in n.args)


def _s2d_imports(module: str) -> set[str]:
    out = set()
    for n in ast.walk(ast.parse(open(module.replace(".", "/") + ".py").read())):
        names = ([n.module] + [f"{n.module}.{a.name}" for a in n.names]
                 if isinstance(n, ast.ImportFrom) and n.module else
                 [a.name for a in n.names] if isinstance(n, ast.Import) else [])
        out |= {m for m in names if m.startswith("s2d_jax.")
                and os.path.isfile(m.replace(".", "/") + ".py")}
    return out


def test_every_flag_an_error_message_names_exists(monkeypatch):
    """A message suggesting a flag is checked against the flags of the commands that can
    show it: a command's own module against its parser, a helper module against the
    commands importing it (all of them when only one does: serve_load's `--max-len` was
    serve_bench's --slot-len). Text naming another command (python -m ...) is skipped."""
    from test_output_rule import COMMANDS, _parser_of, _variants
    monkeypatch.chdir(REPO)
    flags, users = {}, {}
    for m in COMMANDS:
        parser = _parser_of(m)
        if parser is None:
            continue
        flags[m] = {"--help"} | {o for _, ps in _variants(parser) for p in ps
                                 for a in p._actions for o in a.option_strings}
        for lib in _s2d_imports(m):
            users.setdefault(lib, set()).add(m)
    wrong = []
    for module, commands in [(m, {m}) for m in flags] + sorted(users.items()):
        known = set().union(*(flags[c] for c in commands))
        for line, text in _messages(module):
            if "python -m" in text or "pip " in text:
                continue
            wrong += [f"{module}:{line}: {f} (not a flag of {', '.join(sorted(commands))})"
                      for f in _FLAG.findall(text) if f not in known]
    assert not wrong, wrong


# --- training: its inputs before its checkpoint dir and plan ------------------------------

def test_train_refuses_an_init_from_of_another_shape_before_its_checkpoint_dir(tmp_path):
    import jax

    from s2d_jax.train.loop import train
    from test_trainer import synthetic_config
    tc = synthetic_config(tmp_path, f"checkpoint.dir={tmp_path / 'ck'}",
                          f"model.init_from={REPO}/models/smollm2-draft")
    with pytest.raises(S2DError, match="model.init_from .* another shape"):
        train(tc, devices=jax.devices()[:1], progress=False)
    assert not (tmp_path / "ck").exists()  # was made, with the run's plan in it


def test_a_start_that_fails_leaves_no_plan_to_refuse_its_corrected_rerun(tmp_path):
    import jax

    from s2d_jax.train.loop import train
    from test_trainer import synthetic_config
    (tmp_path / "not_progress").mkdir()
    tc = synthetic_config(tmp_path, f"checkpoint.dir={tmp_path / 'ck'}",
                          f"model.continue_from={tmp_path / 'not_progress'}")
    with pytest.raises(S2DError, match="not a run's committed progress"):
        train(tc, devices=jax.devices()[:1], progress=False)
    assert not (tmp_path / "ck" / "run_plan.json").exists()
