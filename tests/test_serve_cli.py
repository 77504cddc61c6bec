"""`python -m infer.serve` and `python -m infer.serve_bench`: one-line errors for bad flags
before anything loads, the load table's arithmetic, and (slow) a tiny load run on the
demo family through the real HTTP interface, AR and S2D side by side."""

import json
import os

import pytest

from infer import serve as serve_cli
from infer import serve_bench
from s2d_jax.bench import serve_load
from tiny_models import cli_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "demo")
TARGET = os.path.join(DEMO, "target-s")


@pytest.mark.parametrize("argv, expect", [
    (["--target", TARGET, "--method", "s2d"], "needs --draft"),
    (["--target", TARGET, "--method", "self"], "needs --exit"),
    (["--target", TARGET, "--method", "ar", "--slots", "0"], "--slots must be >= 1"),
    (["--target", TARGET, "--method", "ar", "--port", "70000"], "--port must be <= 65535"),
    (["--target", TARGET, "--method", "ar", "--slot-len", "1"], "--slot-len must be >= 2"),
    (["--target", TARGET, "--method", "nope"], "invalid choice"),
])
def test_serve_refuses_bad_flags(capsys, argv, expect):
    assert expect in cli_error(serve_cli.main, capsys, argv)


@pytest.mark.parametrize("argv, expect", [
    (["--target", TARGET, "--methods", "ar,nope"], "--methods"),
    (["--target", TARGET, "--methods", "ar,s2d"], "needs --draft"),
    (["--target", TARGET, "--methods", "ar", "--clients", "0,4"], "--clients"),
    (["--target", TARGET, "--methods", "ar", "--requests-per-client", "0"], ">= 1"),
    (["--target", TARGET, "--methods", "ar", "--out", TARGET], "--out"),
    (["--target", TARGET, "--methods", "ar", "--categories", "qa,nope"], "'nope' is not in"),
])
def test_serve_bench_refuses_bad_flags(capsys, tmp_path, argv, expect):
    out = [] if "--out" in argv else ["--out", str(tmp_path / "bench")]
    assert expect in cli_error(serve_bench.main, capsys, argv + out)
    assert not (tmp_path / "bench").exists()


def test_load_table_compares_each_method_with_ar_at_equal_clients():
    rows = [{"method": m, "clients": c, "requests": 4, "seconds": 1.0, "requests_per_s": 4.0,
             "output_tokens_per_s": tps, "ttft_p50_s": 0.01, "ttft_p99_s": 0.02,
             "tpot_p50_s": None, "tpot_p99_s": 0.005, "speculative_chunks": share,
             "alone_tokens_per_s": alone}
            for m, c, tps, share, alone in [("ar", 1, 10.0, 0.0, 11.0), ("ar", 4, 30.0, 0.0, 11.0),
                                            ("s2d", 1, 12.0, 1.0, 13.2),
                                            ("s2d", 4, 27.0, 0.25, 13.2)]]
    lines = serve_load.table(rows).splitlines()
    assert lines[2].endswith("| 1.00x | 1.00x |") and lines[4].endswith("| 1.20x | 1.20x |")
    assert lines[5].endswith("| 0.25 | 13.2 | 0.90x | 1.20x |")
    assert "| 10.0 | 20.0 | - | 5.0 |" in lines[2]  # ms, and None as -


@pytest.mark.slow  # two servers compiled (~3 min on a loaded 2-core CPU)
def test_serve_bench_smoke_run_on_the_demo_family(tmp_path, capsys):
    out = tmp_path / "bench"
    serve_bench.main(["--target", TARGET, "--draft", os.path.join(DEMO, "draft"),
                      "--methods", "ar,s2d", "--clients", "1,2", "--requests-per-client", "1",
                      "--max-new-tokens", "8", "--max-prompts", "4", "--slots", "2",
                      "--slot-len", "128", "--chat-template", "none", "--out", str(out)])
    loads = json.loads((out / "serve_bench.json").read_text())["loads"]
    assert [(r["method"], r["clients"], r["requests"]) for r in loads] == [
        ("ar", 1, 1), ("ar", 2, 2), ("s2d", 1, 1), ("s2d", 2, 2)]
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_p50_s"] > 0 for r in loads)
    assert all(r["alone_tokens_per_s"] > 0 and 0 <= r["speculative_chunks"] <= 1 for r in loads)
    assert all(r["speculative_chunks"] == 0 for r in loads if r["method"] == "ar")
    assert "| s2d | 2 |" in (out / "serve_bench.md").read_text()
