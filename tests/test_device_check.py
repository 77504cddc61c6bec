"""python -m infer.device_check: refuses a CPU without --allow-cpu and bad flags with one
error line; with --allow-cpu it runs the tiny version (and 3 s of draft training) and writes
the report (~40-60 s on a 2-core CPU, most of it XLA compiles: not marked slow, as the
only end-to-end run of the accelerator check). Part (b)'s bandwidth bounds and GEMM
backend comparison: the device-name -> bandwidth map, the default's choice and the report's
lines from made-up GPU numbers; the Triton/cuBLAS compiles and the cuBLAS verify probe on
the CPU, whose XLA accepts and ignores the flag (a few tiny compiles, ~2 s); and, with the
CUDA plugin, a deviceless H100 compile showing the flag picks the kernel (slow)."""

import json
import os

import pytest

import cuda_child
from infer.device_check import device_bandwidth, main, report_md
from s2d_jax.bench import gemm_costs
from tiny_models import cli_error


def test_refuses_a_cpu_without_allow_cpu(tmp_path, capsys):
    out = tmp_path / "dc"
    err = cli_error(main, capsys, ["--out", str(out)])
    assert err.startswith("error: no accelerator: jax.devices() shows only a CPU")
    assert not out.exists()


@pytest.mark.parametrize("value, message", [
    ("vicuna-7b=nan", "--paper-mat vicuna-7b=nan: need one of"),
    ("vicuna-7b=0.5", "--paper-mat vicuna-7b=0.5: need one of"),
    ("llama=3", "--paper-mat llama=3: need one of"),
])
def test_refuses_a_bad_paper_mat(tmp_path, capsys, value, message):
    err = cli_error(main, capsys, ["--out", str(tmp_path / "dc"), "--allow-cpu",
                                   "--paper-mat", value])
    assert err.startswith(f"error: {message}")
    assert not (tmp_path / "dc").exists()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_refuses_a_bad_train_minutes(tmp_path, capsys, value):
    err = cli_error(main, capsys, ["--out", str(tmp_path / "dc"), "--allow-cpu",
                                   "--train-minutes", value])
    assert err.startswith("error: ") and "--train-minutes" in err
    assert not (tmp_path / "dc").exists()


@pytest.mark.slow
def test_allow_cpu_runs_the_tiny_check_and_writes_the_report(tmp_path):
    out = tmp_path / "dc"
    assert main(["--out", str(out), "--allow-cpu", "--samples", "2", "--train-minutes",
                 "0.05", "--bandwidth", "20"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["device"].startswith("cpu")
    greedy = data["smollm2"]["results"]["0.0"]
    assert greedy["ar"]["exact_match_vs_ar"] == 1.0
    assert all(r["exact_match_vs_ar"] == 1.0 for r in greedy.values())  # lossless, greedy
    tiny = data["shapes"]["tiny"]
    assert sorted(tiny["verify_s"]) == ["1", "2"] and len(tiny["draft_step_s"]) == 3
    assert len(tiny["predictions"]) == 3 and all(p["speedup"] > 0 for p in tiny["predictions"])
    report = (out / "report.md").read_text()
    assert "Device: **cpu" in report and "| target verify, window 2 | " in report
    # (b) beside its bounds: --bandwidth on a CPU (no preset), measured / bound >= ~1
    assert data["bandwidth"]["bytes_per_s"] == 20e9
    assert tiny["bound"]["verify_bytes"] > 0 and tiny["bound"]["verify_s"] > 0
    assert set(tiny["vs_bound"]) == {"1", "2"} and all(r > 0 for r in tiny["vs_bound"].values())
    assert "| call | ms | bound ms | measured / bound |" in report
    assert "| target verify, window 1 (AR step) | " in report and "--bandwidth 20 GB/s" in report
    gemm = data["gemm"]  # XLA's own dots, the Triton/cuBLAS comparison n/a on a CPU
    assert gemm["backends"] == ["xla"] and gemm["rows"] == [1, 5]
    assert [s["name"] for s in gemm["shapes"]][-1] == "lm_head"
    row = gemm["shapes"][0]["by_rows"]["1"]
    assert row["faster"] == "n/a on cpu" and row["backends"]["xla"]["copies"] == 0
    assert gemm["choice"]["default"] is None and "n/a on cpu" in gemm["choice"]["why"]
    assert "Triton vs cuBLAS n/a on cpu" in report and "| n/a on cpu |" in report
    assert "GEMM default for the decode shapes: n/a on cpu" in report
    assert os.path.exists(out / "smollm2" / "report.md")
    assert "(ii) with the paper's MAT not computed" in report
    train = data["train"]  # (c): SoFT on the clock, held-out agreement logged
    assert train["exits"] == [1, 2] and train["steps"] > 1 and train["seconds"] >= 3
    assert len(train["log"]) >= 2 and train["log"][-1]["loss"] is not None
    assert all(0 <= a <= 1 for r in train["log"] for a in r["agreement"].values())
    assert "## (c) SoFT of the sorted draft" in report


@pytest.mark.parametrize("flags, message", [
    (["--parts", "b,c"], "--parts must list a and/or b once each"),
    (["--parts", "a,a"], "--parts must list a and/or b once each"),
    (["--windows", "3"], "--windows must be >= 5"),
    (["--bandwidth", "0"], "--bandwidth must be a positive number of GB/s"),
])
def test_refuses_bad_parts_and_windows(tmp_path, capsys, flags, message):
    err = cli_error(main, capsys, ["--out", str(tmp_path / "dc"), "--allow-cpu", *flags])
    assert err.startswith(f"error: {message}"), err
    assert not (tmp_path / "dc").exists()


def test_device_names_map_to_their_bandwidth():
    assert device_bandwidth("NVIDIA H100 80GB HBM3", None)["bytes_per_s"] == 3.35e12
    assert device_bandwidth("NVIDIA H200", None)["bytes_per_s"] == 4.8e12
    assert device_bandwidth("TPU v5 lite", None)["bytes_per_s"] == 819e9
    assert device_bandwidth("NVIDIA A100-SXM4-40GB", None)["bytes_per_s"] == 1.555e12
    for unknown in ("cpu", "NVIDIA H100 PCIe"):  # no preset: no bounds, and how to get them
        bw = device_bandwidth(unknown, None)
        assert bw["bytes_per_s"] is None and "--bandwidth" in bw["source"]
    assert device_bandwidth("cpu", 25.0) == {"bytes_per_s": 25e9,
                                             "source": "--bandwidth 25 GB/s"}


def test_the_vicuna_7b_decode_matmuls():
    from s2d_jax.config import load_model_config
    gemms = gemm_costs.decode_gemms(load_model_config("configs/models/vicuna-7b-v1.5.yaml"))
    assert [(g.name, g.k, g.n, g.per_layer, g.layers) for g in gemms] == [
        ("wq/wk/wv/wo", 4096, 4096, 4, 32), ("w_gate/w_up", 4096, 11008, 2, 32),
        ("w_down", 11008, 4096, 1, 32), ("lm_head", 4096, 32000, 1, 1)]


def test_the_gemm_default_follows_the_model_then_the_kernels():
    kernels = {"triton": {1: 2.0e-3, 5: 2.1e-3}, "cublas": {1: 1.0e-3, 5: 1.2e-3}}
    c = gemm_costs.choose(kernels, "gpu")  # kernels alone: cuBLAS, and the flag for it
    assert c["default"] == "cublas" and c["xla_flags"] == "--xla_gpu_enable_triton_gemm=false"
    slower_model = {"triton": {1: 17.9e-3, 5: 18.4e-3}, "cublas": {1: 19.0e-3, 5: 19.5e-3}}
    c = gemm_costs.choose(kernels, "gpu", slower_model)  # the model's program decides
    assert c["default"] == "triton" and c["xla_flags"] is None and "disagree" in c["why"]
    tie = {"triton": {1: 18.0e-3}, "cublas": {1: 17.9e-3}}
    c = gemm_costs.choose(kernels, "gpu", tie)  # within 3%: XLA's default
    assert c["default"] == "triton" and "no clear winner" in c["why"]
    assert gemm_costs.choose(kernels, "cpu")["default"] is None


def _gpu_results():
    """results.json of a made-up H100 run: one shape, one GEMM shape at 1 row."""
    t = lambda s, k: {"s": s, "gbps": 2.9 / s, "kernels": [k], "copies": 0}  # noqa: E731
    step = {"triton": {1: 3.5e-3}, "cublas": {1: 1.4e-3}}
    return {"device": "NVIDIA H100 80GB HBM3 (gpu, 1 device(s))", "platform": "gpu",
            "bandwidth": device_bandwidth("NVIDIA H100 80GB HBM3", None), "smollm2": None,
            "shapes": {"vicuna-7b": {
                "verify_s": {1: 17.9e-3, 5: 18.4e-3}, "draft_step_s": {6: 4.1e-3},
                "bound": {"verify_bytes": 14.3e9, "verify_s": 14.3e9 / 3.35e12,
                          "draft_step_bytes": {6: 3.2e9}, "draft_step_s": {6: 3.2e9 / 3.35e12}},
                "verify_by_backend": {"triton": {1: 17.9e-3, 5: 18.4e-3},
                                      "cublas": {1: 14.0e-3, 5: 14.8e-3},
                                      "split-k": {1: 18.6e-3, 5: 19.1e-3}}}},
            "gemm": {"model": "vicuna-7b", "platform": "gpu", "rows": [1],
                     "backends": ["triton", "cublas"], "flag": gemm_costs.TRITON_FLAG,
                     "shapes": [{"name": "w_gate/w_up", "k": 4096, "n": 11008, "per_layer": 1,
                                 "layers": 32, "by_rows": {1: {
                                     "backends": {"triton": t(3.5e-3, "triton"),
                                                  "cublas": t(1.4e-3, "cublas")},
                                     "faster": "cublas", "ratio": 2.5}}}],
                     "step_s": step,
                     "choice": gemm_costs.choose(step, "gpu", {
                         "triton": {1: 17.9e-3, 5: 18.4e-3}, "cublas": {1: 14.0e-3, 5: 14.8e-3}})},
            "train": None}


def test_the_report_sets_gpu_calls_beside_their_bounds_and_names_the_gemm_flag():
    report = report_md(_gpu_results())
    assert "A verify call reads 14.30 GB (weights + KV cache). Bounds at 3.35 TB/s" in report
    assert "| target verify, window 1 (AR step) | 17.900 | 4.269 | 4.19x |" in report
    assert "| draft step, exit 6 | 4.100 | 0.955 | 4.29x |" in report
    assert ("| w_gate/w_up 32 x [4096, 11008] | 1 | 3.500 | 829 (25%) | 1.400 | 2071 (62%) "
            "| triton, cublas | cublas 2.50x |") in report
    assert "- the model's verify call of 5 token(s): Triton in one pass (default) 18.400 ms, " \
           "cuBLAS 14.800 ms, Triton with split-K 19.100 ms" in report
    assert "**GEMM default for the decode shapes: cublas**" in report
    assert "set `XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`" in report
    assert "The library's defaults are unchanged." in report


def test_the_triton_and_cublas_compiles_run_on_a_cpu():
    """The GPU path's code on the CPU (XLA:CPU accepts xla_gpu_enable_triton_gemm and
    ignores it; a misspelt option is an error): both backends compiled and timed, the
    faster picked, a default chosen; and the verify probe compiled with the flag. Tiny
    shapes, ~2 s."""
    from s2d_jax.bench.call_costs import verify_probe
    from s2d_jax.config import ModelConfig
    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=2, max_position_embeddings=64,
                      dtype="bfloat16", param_dtype="bfloat16")  # every projection [32, 32]
    lines = []
    entry = gemm_costs.time_gemms(cfg, "gpu", 2, rows=(1,), on_host=True, progress=lines.append)
    assert [s["name"] for s in entry["shapes"]] == ["wq/wk/wv/wo/w_gate/w_up/w_down", "lm_head"]
    for s in entry["shapes"]:
        row = s["by_rows"][1]
        assert set(row["backends"]) == {"triton", "cublas"}
        assert all(t["kernels"] == ["xla"] and t["copies"] == 0 for t in row["backends"].values())
        assert row["faster"] in ("triton", "cublas", "- (not timed)")
    assert len(lines) == 2 and all(" faster by " in m or "not timed" in m for m in lines)
    assert entry["choice"]["default"] in ("triton", "cublas", None)
    from tiny_models import numpy_params
    from s2d_jax.decode.engine import GPU_COMPILER_OPTIONS
    # part (b)'s verify variants: cuBLAS, the engine's one-pass GEMMs, XLA's split-K
    for options in (gemm_costs.BACKENDS["cublas"], GPU_COMPILER_OPTIONS,
                    {"xla_gpu_experimental_force_split_k": 0}):
        probe = verify_probe(numpy_params(cfg), cfg, window=1, block=1, start=8, max_len=32,
                             compiler_options=options)
        probe.sample()
        assert len(probe.times[0]) == 1


H100_GEMMS = r'''
from s2d_jax.parallel import topology
devs = topology.devices("h100:1")
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from s2d_jax.bench import gemm_costs
sh = SingleDeviceSharding(devs[0])
ws = tuple(jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=sh) for _ in range(2))
x = jax.ShapeDtypeStruct((5, 512), jnp.bfloat16, sharding=sh)
low = jax.jit(gemm_costs._gemm_loop).lower(ws, x, jax.ShapeDtypeStruct((), jnp.int32, sharding=sh))
out = {}
for b, opts in gemm_costs.BACKENDS.items():
    hlo = low.compile(opts).as_text()
    out[b] = (gemm_costs.kernels(hlo), gemm_costs.copies(hlo, 512, 1024))
print(out)
'''


@pytest.mark.slow
@cuda_child.needs_plugin
def test_the_flag_given_per_compile_switches_xla_gpu_between_triton_and_cublas():
    """A deviceless H100 compile (the CUDA plugin, no GPU) of the GEMM loop: the per-compile
    option is what picks the kernel, and each layer's matrix is read in place."""
    found = eval(cuda_child.run(H100_GEMMS).stdout.strip().splitlines()[-1])
    assert found == {"triton": (["triton"], 0), "cublas": (["cublas"], 0)}, found
