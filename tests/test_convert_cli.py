"""`python -m infer.convert`: conversions end to end, and bad input -> one error line, exit 2,
nothing at the output path."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
# the `bench` extra's torch (HF reference models); `.[test]` leaves it out: a CUDA wheel is GBs
torch = pytest.importorskip("torch")
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from infer.convert import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = "/work/shared/data/llama2_tokenizer"


def convert(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "infer.convert", *map(str, args)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    hc = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(hc).eval()
    path = tmp_path_factory.mktemp("src") / "hf"
    model.save_pretrained(str(path))
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_help_documents_every_command(capsys):
    for argv in ([], ["hf-to-orbax"], ["orbax-to-hf"], ["hf-to-hf"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        if argv:
            assert all(flag in out for flag in ("--src", "--out", "--num-layers", "--dtype",
                                                "--overwrite"))
        else:
            assert all(c in out for c in ("hf-to-orbax", "orbax-to-hf", "hf-to-hf"))


def test_hf_to_orbax_to_hf_round_trip(hf_dir, tmp_path):
    src, state = hf_dir
    rc, _, err = convert("hf-to-orbax", "--src", src, "--out", tmp_path / "ckpt",
                         "--tokenizer", TOKENIZER_DIR)
    assert rc == 0, err
    assert os.path.isfile(tmp_path / "ckpt" / "s2d_config.json")
    assert os.path.isfile(tmp_path / "ckpt" / "tokenizer.model")
    rc, _, err = convert("orbax-to-hf", "--src", tmp_path / "ckpt", "--out", tmp_path / "back")
    assert rc == 0, err
    # the tokenizer travels with the checkpoint when --tokenizer is not given
    with open(os.path.join(TOKENIZER_DIR, "tokenizer.model"), "rb") as f:
        assert (tmp_path / "back" / "tokenizer.model").read_bytes() == f.read()
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(state)
    for k in state:
        assert torch.equal(back[k], state[k]), k
    assert sorted(os.listdir(tmp_path)) == ["back", "ckpt"]  # no temp dirs left behind


def test_hf_to_hf_draft_truncation_and_overwrite(hf_dir, tmp_path):
    src, state = hf_dir
    out = tmp_path / "draft"
    rc, _, err = convert("hf-to-hf", "--src", src, "--out", out, "--num-layers", 1)
    assert rc == 0, err
    (out / "stale.txt").write_text("old")  # inside an earlier output (it has the marker)
    rc, _, err = convert("hf-to-hf", "--src", src, "--out", out, "--num-layers", 2,
                         "--dtype", "bfloat16", "--overwrite")
    assert rc == 0, err
    assert not os.path.exists(out / "stale.txt")
    draft = LlamaForCausalLM.from_pretrained(str(out))
    assert draft.config.num_hidden_layers == 2
    got = draft.state_dict()
    assert got["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16
    for k, v in got.items():
        assert torch.equal(v, state[k].to(torch.bfloat16)), k


def _copy(src, dst):
    dst.mkdir()
    for f in os.listdir(src):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


def _edit_config(d, **changes):
    c = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    c.pop("rope_parameters", None) if "rope_scaling" in changes else None
    (d / "config.json").write_text(json.dumps(c))
    return d


def _bad_sources(src, root):
    """name -> (args, expected fragment of the error line)."""
    cases = {}
    cases["missing_dir"] = (["hf-to-orbax", "--src", root / "nope"], "not a directory")
    d = root / "no_weights"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    cases["missing_weights"] = (["hf-to-orbax", "--src", d], "no weights")
    d = _copy(src, root / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated_weights"] = (["hf-to-orbax", "--src", d], "re-download")
    d = _copy(src, root / "corrupt_bin")
    os.remove(d / "model.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"this is not a torch file" * 10)
    cases["corrupt_bin"] = (["hf-to-hf", "--src", d], "cannot read")
    d = _edit_config(_copy(src, root / "no_hidden"), hidden_size=None)
    cases["config_missing_field"] = (["hf-to-orbax", "--src", d], "hidden_size")
    d = _edit_config(_copy(src, root / "shape"), intermediate_size=48)
    cases["shape_mismatch"] = (["hf-to-orbax", "--src", d], "disagree")
    d = _edit_config(_copy(src, root / "rope"), rope_scaling={"rope_type": "yarnish", "factor": 2})
    cases["unknown_rope"] = (["hf-to-orbax", "--src", d], "yarnish")
    cases["not_a_checkpoint"] = (["orbax-to-hf", "--src", src], "s2d_config.json")
    cases["too_many_layers"] = (["hf-to-hf", "--src", src, "--num-layers", 7], "num_layers=7")
    cases["bad_tokenizer"] = (["hf-to-hf", "--src", src, "--tokenizer", root / "no_weights"],
                              "no tokenizer files")
    return cases


def test_bad_input_one_error_line_exit_2_nothing_written(hf_dir, tmp_path):
    src, _ = hf_dir
    (tmp_path / "in").mkdir()
    cases = _bad_sources(src, tmp_path / "in")
    with ThreadPoolExecutor(4) as pool:  # the subprocesses mostly wait on imports
        results = pool.map(lambda item: convert(*item[1][0], "--out", tmp_path / "out" / item[0]),
                           cases.items())
    failures = []
    for (name, (_, fragment)), (rc, _, stderr) in zip(cases.items(), results):
        out = tmp_path / "out" / name
        lines = [line for line in stderr.splitlines() if line.strip()]
        ok = (rc == 2 and len(lines) == 1 and lines[0].startswith("error: ")
              and fragment in lines[0] and not os.path.lexists(out))
        if not ok:
            failures.append((name, rc, stderr[-500:]))
    left = os.listdir(tmp_path / "out") if os.path.exists(tmp_path / "out") else []
    assert not failures
    assert left == []  # no temp dirs next to the outputs either


def test_existing_output_is_kept_without_overwrite(hf_dir, tmp_path):
    src, _ = hf_dir
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = convert("hf-to-orbax", "--src", src, "--out", out)
    assert rc == 2 and err.strip().startswith("error: ") and "--overwrite" in err
    assert os.listdir(out) == ["keep.txt"]
