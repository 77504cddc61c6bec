"""Interrupted runs (SIGINT / SIGTERM mid-write) exit 130 with one error line and leave
nothing at the output path and no temp files; --overwrite keeps the old output until the
new one is complete; created outputs honour the umask. The interrupt cases need a
subprocess and are marked slow."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from test_cli_fuzz import DEMO, REPO, check_one_error, snapshot

D = os.path.join(DEMO, "draft")


def _interrupt_when(cmd, appears, sig, timeout=300.0):
    """Run cmd; once `appears()` is true, send `sig`; (returncode, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", *cmd], cwd=REPO, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    t0 = time.time()
    while proc.poll() is None and not appears() and time.time() - t0 < timeout:
        time.sleep(0.005)
    sent = proc.poll() is None
    if sent:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    assert sent, f"{cmd[0]} finished before it could be interrupted: {err}"
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_interrupted_convert_leaves_nothing(tmp_path, sig):
    out = tmp_path / "out"
    (tmp_path / "keep.txt").write_text("precious\n")
    before = snapshot(tmp_path)

    def writing():  # the temp dir of atomic_output_dir holds a file being written
        return any(n.startswith(".out.tmp-") and os.listdir(tmp_path / n)
                   for n in os.listdir(tmp_path))

    code, err = _interrupt_when(
        ["infer.convert", "hf-to-hf", "--src", os.path.join(DEMO, "target-l"), "--out",
         str(out), "--dtype", "float32"], writing, sig)
    check_one_error(code, err, ("interrupted", "rerun"), expect_code=130)
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_interrupted_overwrite_keeps_the_old_output(tmp_path):
    """--overwrite replaces an output only once the new one is complete."""
    out = tmp_path / "out"
    shutil.copytree(D, out)
    before = snapshot(tmp_path)

    def writing():
        return any(n.startswith(".out.tmp-") and os.listdir(tmp_path / n)
                   for n in os.listdir(tmp_path))

    code, err = _interrupt_when(
        ["infer.convert", "hf-to-hf", "--src", os.path.join(DEMO, "target-l"), "--out",
         str(out), "--overwrite", "--dtype", "float32"], writing, signal.SIGTERM)
    check_one_error(code, err, ("interrupted", "rerun"), expect_code=130)
    assert snapshot(tmp_path) == before


# --- created outputs honour the umask ----------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002], ids=["022", "077", "002"])
def test_outputs_honour_the_umask(tmp_path, umask):
    from s2d_jax.io.atomic import atomic_output_dir, write_atomic

    old = os.umask(umask)
    try:
        write_atomic(str(tmp_path / "f.json"), "{}")
        with atomic_output_dir(str(tmp_path / "d")) as tmp:
            os.makedirs(os.path.join(tmp, "sub"))
            open(os.path.join(tmp, "sub", "w.bin"), "wb").close()
    finally:
        os.umask(old)
    mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "f.json") == 0o666 & ~umask
    assert mode(tmp_path / "d") == 0o777 & ~umask
    assert mode(tmp_path / "d" / "sub") == 0o777 & ~umask
    assert mode(tmp_path / "d" / "sub" / "w.bin") == 0o666 & ~umask
