"""What the training loop calls after every step (s2d_jax/train/loop.run_steps).

A hook is a callable `hook(step, state, record)`: `record` is the step's metrics line
(loop.metrics_record) on logged steps, else None. It runs after the step's checkpoint is
saved. A hook with a `close()` method is closed when the run ends, crashed or not.
"""

from __future__ import annotations

import json
import os

import jax


class MetricsLog:
    """JSONL metrics (process 0 only), flushed each line so a crash loses nothing logged."""

    def __init__(self, path: str):
        self.f = None
        if path and jax.process_index() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.f = open(path, "a")

    def __call__(self, step, state, record) -> None:
        if self.f and record is not None:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()


class ProgressBar:
    """A tqdm bar over the run's steps with each exit's last logged loss and tokens/s."""

    def __init__(self, total_steps: int, start: int):
        from tqdm import tqdm
        self.bar = tqdm(total=total_steps, initial=start, desc="soft", dynamic_ncols=True)

    def __call__(self, step, state, record) -> None:
        if record is not None:
            self.bar.set_postfix({**{f"L{e}": f"{v:.3f}" for e, v in record["exit_loss"].items()},
                                  "tok/s": f"{record['tokens_per_s']:.0f}"}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def crash_after(stop_step: int, manager=None):
    """A hook that hard-exits the process (code 3) right after step `stop_step`, once the
    checkpoint writes finish: a simulated crash, to test resuming (TrainConfig's
    stop_after_step)."""

    def hook(step, state, record) -> None:
        if step == stop_step:
            if manager:
                manager.wait_until_finished()
            os._exit(3)

    return hook


def close_all(hooks) -> None:
    for hook in hooks:
        close = getattr(hook, "close", None)
        if close:
            close()
