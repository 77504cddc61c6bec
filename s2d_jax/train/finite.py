"""Stop training when the loss turns NaN or inf, without a host sync every step.

Each step folds "are this step's loss and gradient norm finite" into device scalars
(the first bad step, 0 while all are finite, and its values); the loop reads them back
only at log and checkpoint boundaries and before the end, so a non-finite state is never
checkpointed or exported, and the error still names the step where it first appeared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.errors import S2DError


@jax.jit
def _fold(seen, step, loss, grad_norm):
    first, _, _ = seen
    new = (first == 0) & ~(jnp.isfinite(loss) & jnp.isfinite(grad_norm))
    return jax.tree.map(lambda old, now: jnp.where(new, now, old), seen,
                        (step, loss.astype(jnp.float32), grad_norm.astype(jnp.float32)))


class FiniteWatch:
    """Remembers the first step whose loss or gradient norm is NaN or inf."""

    def __init__(self):
        # numpy, not device arrays: on several hosts jit takes them as replicated inputs
        self.seen = (np.int32(0), np.float32(0), np.float32(0))

    def observe(self, step: int, metrics: dict) -> None:
        self.seen = _fold(self.seen, np.int32(step), metrics["loss"], metrics["grad_norm"])

    def check(self, manager=None) -> None:
        """Raise S2DError naming the first bad step; pending checkpoint writes finish first."""
        first, loss, grad_norm = (x.item() for x in jax.device_get(self.seen))
        if not first:
            return
        kept = "no checkpoint was saved"
        if manager is not None:
            manager.wait_until_finished()
            last = manager.latest_step()
            if last is not None:
                kept = (f"the last checkpoint, step {last} in {manager.directory}, is kept and "
                        f"a rerun resumes from it")
        raise S2DError(f"training diverged at step {first} (loss {loss:.4g}, gradient norm "
                       f"{grad_norm:.4g}); stopped without saving that state: {kept}. Lower "
                       f"optimizer.lr (or raise warmup_steps) or check the data")
