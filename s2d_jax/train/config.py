"""The training config: typed sections loaded from YAML with `key=value` overrides.

`python -m train.soft --config configs/train/cpu_soft.yaml optimizer.lr=1e-3 mesh.data=2`
"""

from __future__ import annotations

import dataclasses

from s2d_jax.config import load_config
from s2d_jax.errors import S2DError
from s2d_jax.model.transformer import REMAT_POLICIES
from s2d_jax.parallel.mesh import MeshConfig
from s2d_jax.model.sorted_draft import DraftConfig
from s2d_jax.train.data import DataConfig


INIT_DEEPER = ("target", "identity")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Where the draft comes from.

    `path` is a model YAML (configs/models/*.yaml: random init, the draft has the YAML's
    num_layers) or an HF / orbax checkpoint directory (the first `draft.exits[-1]` layers
    are loaded: draft initialised from a target). `overrides` are `key=value` ModelConfig
    overrides applied to a YAML (e.g. `num_layers=4`). Empty dtypes keep the model's.
    """

    path: str = ""
    overrides: tuple[str, ...] = ()
    # With no checkpoint to resume: start from these committed draft weights (a draft pack
    # such as models/smollm2-draft, or an HF draft dir) rather than the target's first
    # layers; what they do not hold is lost (s2d_jax/train/warm_start.py). "" = off.
    init_from: str = ""
    # The layers a deeper draft adds below init_from's: "target" (the target's own) or
    # "identity" (the target's, with their residual outputs wo and w_down zeroed: each
    # starts as the identity, so the new deepest exit starts equal to init_from's deepest,
    # the block expansion of LLaMA Pro, arXiv 2401.02415).
    init_deeper: str = "target"
    # This same run's committed progress (a draft pack written when a run stopped at its
    # time budget, with the recipe of its plan and step): with no checkpoint to resume, the
    # run continues at that step with its data position; only the optimizer moments are
    # lost (s2d_jax/train/continuation.py). A path that does not exist yet = start as
    # usual. "" = off.
    continue_from: str = ""
    dtype: str = ""  # compute dtype
    param_dtype: str = ""  # dtype of the trained (master) params


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 2e-5
    warmup_steps: int = 0
    total_steps: int = 0  # 0 = from data.num_epochs and the dataset size
    end_lr_ratio: float = 0.0  # cosine decays to lr * end_lr_ratio
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0 = no clipping
    grad_accum_steps: int = 1
    # Param paths kept at their initial values, e.g. [embed]: a draft sharing its target's
    # tied embedding stores only its own layers and norm.
    frozen: tuple[str, ...] = ()
    # The first N layers of the stack kept at their initial values, with the final norm,
    # so the exits at depth <= N stay exactly as initialised (a deeper exit added to a
    # trained draft, model.init_from); those exits leave the loss and the frozen layers'
    # backward pass is not computed (sorted_draft.soft_sums). 0 = off.
    frozen_layers: int = 0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # "" = no checkpoints
    save_every: int = 1000
    keep_last: int = 3
    async_save: bool = False


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSection = ModelSection()
    draft: DraftConfig = DraftConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    remat: str = "none"
    seed: int = 0
    metrics_path: str = ""  # JSONL, one line per logged step
    log_every: int = 1
    export_dir: str = ""  # HF dir for the trained draft, written at the end
    export_overwrite: bool = False
    # Deterministic synthetic batches (tests, benchmarks): no files or tokenizer needed.
    synthetic_data: bool = False
    # Debug: hard-exit the process right after finishing this step (0 = off); used to
    # test resuming after a crash.
    stop_after_step: int = 0
    # Stop cleanly (checkpoint saved, draft exported) after the first step that ends this
    # many minutes after the run started: a long run spread over sessions. 0 = off.
    stop_after_minutes: float = 0.0

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise S2DError(f"remat={self.remat!r} is not one of {', '.join(REMAT_POLICIES)}")
        o = self.optimizer
        if o.grad_accum_steps < 1:
            raise S2DError(f"optimizer.grad_accum_steps must be >= 1, got {o.grad_accum_steps}")
        if o.lr <= 0 or o.warmup_steps < 0 or o.total_steps < 0:
            raise S2DError("optimizer.lr must be > 0 and warmup_steps/total_steps >= 0")
        _check_optimizer_ranges(o)
        if self.log_every < 1:
            raise S2DError(f"log_every must be >= 1 (log every N steps), got {self.log_every}")
        if self.stop_after_step < 0:
            raise S2DError(f"stop_after_step must be >= 0 (0 = off), got {self.stop_after_step}")
        if not self.stop_after_minutes >= 0:  # NaN and inf: refused by the config loader
            raise S2DError(f"stop_after_minutes must be >= 0 (0 = off), got "
                           f"{self.stop_after_minutes}")
        if self.checkpoint.dir and (self.checkpoint.save_every < 1 or self.checkpoint.keep_last < 1):
            raise S2DError("checkpoint.save_every and checkpoint.keep_last must be >= 1")
        if self.model.init_deeper not in INIT_DEEPER:
            raise S2DError(f"model.init_deeper={self.model.init_deeper!r} is not one of "
                           f"{', '.join(INIT_DEEPER)}")
        if not self.model.path:
            raise S2DError("model.path is empty; set it to a model YAML or an HF/orbax dir")
        if self.mesh.data < 1 or self.mesh.fsdp < 1 or self.mesh.tensor < 1:
            raise S2DError(f"mesh sizes must be >= 1, got {self.mesh}")


def _check_optimizer_ranges(o: OptimizerConfig) -> None:
    """optax takes any float; out of these ranges it trains garbage or NaN."""
    for name, ok, want in (("b1", 0 <= o.b1 < 1, "in [0, 1)"), ("b2", 0 <= o.b2 < 1, "in [0, 1)"),
                           ("eps", o.eps > 0, "> 0"),
                           ("weight_decay", o.weight_decay >= 0, ">= 0"),
                           ("clip_norm", o.clip_norm >= 0, ">= 0 (0 = no clipping)"),
                           ("end_lr_ratio", 0 <= o.end_lr_ratio <= 1, "in [0, 1]"),
                           ("frozen_layers", o.frozen_layers >= 0, ">= 0 (0 = off)")):
        if not ok:
            raise S2DError(f"optimizer.{name} must be {want}, got {getattr(o, name)}")


def load_train_config(path: str | None, overrides=()) -> TrainConfig:
    from s2d_jax import validate
    return load_config(TrainConfig, validate.path(path, "path", optional=True),
                       validate.strings_list(overrides, "overrides"))
