"""The static side of one decoding: the chain's models bottom-up, the round's shape
(SpecConfig) and the mesh, as one hashable object.

The jitted engine functions take it as their one static argument (`chain=`), as gemma's
sampler loop is `self` of its jitted loop: two generations compile the same program iff
their Chains are equal. It is built, and checked, once (by `Decoder`, the AOT setup or a
test); the round, the engine and the cost probes read their configs from it.

Levels: 0 = the draft (None for `ar` and `lookup`, cut to its deepest exit: its cache holds only those
layers), 1 .. n-2 = the intermediate models of a polybasic chain (one per `spec.mus`),
n-1 = the target.
"""

from __future__ import annotations

import contextlib
import dataclasses

from jax.sharding import Mesh

from s2d_jax.config import ModelConfig
from s2d_jax.decode.state import SpecConfig
from s2d_jax.errors import S2DError
from s2d_jax.model import layers, small_matmul
from s2d_jax.model.exits import exits_problem
from s2d_jax.parallel.mesh import with_auto_axes


@dataclasses.dataclass(frozen=True)
class Chain:
    draft: ModelConfig | None
    mids: tuple[ModelConfig, ...]
    target: ModelConfig
    spec: SpecConfig
    mesh: Mesh | None = None  # kept with Auto axes (parallel.mesh.with_auto_axes)

    def __post_init__(self):
        spec = self.spec
        object.__setattr__(self, "mids", tuple(self.mids))
        object.__setattr__(self, "mesh", with_auto_axes(self.mesh))
        if len(self.mids) != len(spec.mus):
            raise S2DError(f"got {len(spec.mus)} mu value(s) for {len(self.mids)} intermediate "
                           f"model(s); pass one mu per intermediate")
        if not spec.proposer.exits:  # no draft model: an empty block / the context
            object.__setattr__(self, "draft", None)
            self._check_vocab()
            return
        if self.draft is None:
            raise S2DError(f"method {spec.method} needs a draft model; pass --draft")
        depth = self.draft.num_layers
        problem = exits_problem(spec.exits, depth)
        if problem:
            raise S2DError(f"exits {list(spec.exits)} do not fit the draft: {problem}; pick "
                           f"increasing exits <= {depth}")
        self._check_vocab()
        if depth != spec.exits[-1]:  # the draft's cache needs only the layers drafted with
            object.__setattr__(self, "draft",
                               dataclasses.replace(self.draft, num_layers=spec.exits[-1]))

    def _check_vocab(self):
        for what, cfg in [("draft", self.draft)] + [(f"intermediate {i}", c)
                                                   for i, c in enumerate(self.mids)]:
            if cfg is not None and cfg.vocab_size != self.target.vocab_size:
                raise S2DError(f"{what} vocab_size {cfg.vocab_size} differs from the target's "
                               f"vocab_size {self.target.vocab_size}; use a model with the "
                               f"target's tokenizer")

    @property
    def cfgs(self) -> tuple:
        """Every level's config bottom-up: (draft, intermediates..., target)."""
        return (self.draft,) + self.mids + (self.target,)

    @property
    def context(self) -> int:
        """Positions every model of the chain can attend over."""
        return min(c.max_position_embeddings for c in self.cfgs if c is not None)

    def with_max_len(self, max_len: int) -> "Chain":
        """The same chain over a token / cache buffer of `max_len` slots per row."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, max_len=max_len))

    @contextlib.contextmanager
    def kernel_scope(self):
        """The context the chain's programs are traced in: the small-matmul kernel only
        where they run unsharded (small_matmul.for_mesh), decode layers over static weight
        slices on GPUs (layers.for_platform)."""
        with small_matmul.for_mesh(self.mesh), layers.for_platform(self.mesh):
            yield
