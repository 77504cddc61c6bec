"""The bad inputs issue 41 found on the surfaces added since the first safety round (chat,
device check, data engine, scaling study and report, prompt files), each one `error:` line,
exit 2 and the workspace unchanged (or the right behaviour where the input is valid)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from s2d_jax.errors import S2DError
from test_cli_fuzz import DEMO, REPO, check_one_error, snapshot
from test_output_rule import COMMANDS, _parser_of

T = os.path.join(DEMO, "target-s")


@pytest.fixture
def ws(tmp_path, monkeypatch):
    shutil.copytree(T, tmp_path / "T", symlinks=True)
    (tmp_path / "t.txt").write_text("Hello\n/quit\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _refused(module, argv, root, keywords, capsys):
    before = snapshot(root)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main([str(a) for a in argv])
    check_one_error(e.value.code, capsys.readouterr().err, keywords)
    assert snapshot(root) == before


def test_chat_out_is_its_script_or_inside_the_model(ws, capsys):
    chat = ["--target", "T", "--method", "ar", "--script", "t.txt", "--out"]
    _refused("infer.chat", chat + ["t.txt"], ws, ["is the input --script"], capsys)
    _refused("infer.chat", chat + ["T/config.json"], ws, ["lies inside the input --target"],
             capsys)


def test_device_check_keeps_another_tools_report_and_the_cwd(ws, capsys):
    (ws / "runs").mkdir()
    (ws / "runs" / "report.md").write_text("the bench's report\n")
    _refused("infer.device_check", ["--allow-cpu", "--out", "runs"], ws,
             ["did not write", "choose a new or empty directory"], capsys)
    _refused("infer.device_check", ["--allow-cpu", "--out", "."], ws,
             ["current directory"], capsys)


@pytest.mark.parametrize("module", [m for m in COMMANDS if _parser_of(m) is not None and any(
    "--max-new-tokens" in a.option_strings for a in _parser_of(m)._actions)])
def test_max_new_tokens_past_int32_in_every_command(ws, capsys, module):
    """Found by the code: every command with --max-new-tokens refuses 3e9 while parsing."""
    parser = _parser_of(module)
    with pytest.raises(S2DError, match="32-bit"):
        parser.parse_args(["--max-new-tokens", "3000000000"])


def test_a_latin1_byte_typed_into_chat_is_refused_and_the_chat_goes_on(ws):
    r = subprocess.run([sys.executable, "-m", "infer.chat", "--target", "T", "--method", "ar",
                        "--chat-template", "none", "--max-new-tokens", "2"],
                       input=b"caf\xe9\nHello\n", capture_output=True, cwd=ws, timeout=300,
                       env={**os.environ, "LC_ALL": "C", "PYTHONPATH": REPO})
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err[-2000:]
    assert "not UTF-8 text" in err and "Traceback" not in err
    assert b"assistant> " in r.stdout  # the next line was answered


def test_a_prompts_file_whose_rows_change_key_names_the_line(ws):
    from s2d_jax.data.distill import prompts_from_file
    (ws / "p.jsonl").write_text('{"question": "a"}\n{"prompt": "b"}\n')
    with pytest.raises(S2DError, match=r"p.jsonl:2 has no text 'question'"):
        prompts_from_file(str(ws / "p.jsonl"))


def _point(tokens, hits):
    return {"shape": "4 layers", "kind": "on_policy", "tokens": tokens, "exit": 2,
            "agreement": sum(hits) / 20, "se": 0.05, "prompt_hits": list(hits),
            "prompt_tokens": [10, 10]}


def test_scaling_report_on_a_two_prompt_or_hand_edited_points_file(ws, capsys):
    two = [_point(1000, (3, 5)), _point(10000, (4, 6)), _point(100000, (5, 7))]
    (ws / "two.jsonl").write_text("".join(json.dumps(p) + "\n" for p in two))
    from infer import scaling_report
    assert scaling_report.main(["--points", "two.jsonl", "--out", "rep"]) == 0  # was LinAlgError
    assert "independent errors" in (ws / "rep" / "table.md").read_text()
    (ws / "cut.jsonl").write_text(json.dumps(two[0])[:40] + "\n")
    _refused("infer.scaling_report", ["--points", "cut.jsonl", "--out", "rep2"], ws,
             ["not valid JSON"], capsys)
    (ws / "shape.jsonl").write_text(json.dumps({**two[0], "shape": 5}) + "\n")
    _refused("infer.scaling_report", ["--points", "shape.jsonl", "--out", "rep2"], ws,
             ["shape must be a non-empty string"], capsys)


def test_a_failed_engine_run_leaves_no_empty_work_dir(ws, capsys):
    """The target dir exists but holds no model: the run fails after parsing, and the
    --work it created is gone again."""
    (ws / "empty_target").mkdir()
    data = os.path.join(REPO, "data")
    _refused("train.data_engine", ["--target", "empty_target", "--work", "new/work",
                                   "--documents", "", "--references", "0",
                                   "--prompts", os.path.join(data, "gsm8k_train.jsonl"),
                                   "--heldout", os.path.join(data, "demo_calibration.jsonl")],
             ws, ["config.json"], capsys)
    assert not os.path.exists(ws / "new")
