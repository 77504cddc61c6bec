"""`python -m infer.serve` and `python -m infer.serve_bench`: one-line errors for bad flags
before anything loads, a port it cannot listen on reported before compiling, SIGTERM during
the warm-up (and, slow, while serving) stopping it within seconds without an error, the
load table's arithmetic, and (slow) a tiny load run on the demo family through the real
HTTP interface, AR and S2D side by side."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
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
    (["--target", TARGET, "--method", "ar", "--max-body-mb", "0"], "--max-body-mb must be > 0"),
])
def test_serve_refuses_bad_flags(capsys, argv, expect):
    assert expect in cli_error(serve_cli.main, capsys, argv)


SERVE = [sys.executable, "-m", "infer.serve", "--target", TARGET, "--method", "ar",
         "--slots", "2", "--slot-len", "64", "--chunk-rounds", "2"]


class Serving:
    """`python -m infer.serve` in a subprocess, its stderr lines collected as they come."""

    def __init__(self, *flags):
        self.lines: list[str] = []
        self.proc = subprocess.Popen([*SERVE, *flags], cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            hit = [line for line in self.lines if text in line]
            if hit:
                return hit[0]
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} line in {timeout} s: {self.lines}")

    def stop(self, timeout: float) -> tuple[int, float]:
        """SIGTERM -> (exit status, seconds it took)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        finally:
            self.proc.kill()
            self.reader.join(5)
        return code, time.monotonic() - t0


@pytest.mark.parametrize("host, expect", [("127.0.0.1", "in use"),
                                          ("203.0.113.7", "not an address of this machine")])
def test_a_port_it_cannot_listen_on_is_one_error_line_before_loading(host, expect):
    with socket.socket() as held:  # a server already on the port
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        done = subprocess.run([*SERVE, "--host", host, "--port", str(port)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        took = time.monotonic() - t0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert expect in errors[0] and f"{host}:{port}" in errors[0], errors[0]
    assert "compiling" not in done.stderr and "Errno" not in done.stderr, done.stderr
    assert took < 30, f"{took:.0f} s: it loaded or compiled before checking the port"


def test_sigterm_during_the_warm_up_stops_it_within_seconds_without_an_error():
    serving = Serving("--port", "0")
    try:
        serving.wait_for("compiling", 120)
        time.sleep(3)  # loading and compiling now (the warm-up takes tens of seconds)
        assert not [line for line in serving.lines if "warmed" in line], serving.lines
    finally:
        code, took = serving.stop(30)
    assert took < 5, f"{took:.1f} s to stop on SIGTERM"
    # (a traceback of JAX's own, a CUDA plugin that fails to load, may precede: not ours)
    assert code == 0 and not [line for line in serving.lines if line.startswith("error")
                              or "KeyboardInterrupt" in line], (code, serving.lines)
    assert serving.lines[-1] == "stopped during the warm-up", serving.lines


@pytest.mark.slow  # a full warm-up in a subprocess (~1 min on a loaded 2-core CPU)
def test_sigterm_while_serving_stops_it_within_seconds_without_an_error():
    serving = Serving("--port", "0")
    try:
        url = serving.wait_for("serving", 600).split(" on ")[-1]
        r = httpx.post(url + "/completions", json={"model": "target-s", "prompt": "ROMEO:",
                                                    "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        code, took = serving.stop(30)
    assert took < 10 and code == 0, (code, took, serving.lines)
    assert not [line for line in serving.lines if line.startswith("error")
                or "KeyboardInterrupt" in line], serving.lines
    assert serving.lines[-1] == "stopped", serving.lines


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
