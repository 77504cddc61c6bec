"""Training data: tokenized examples -> grain pipeline -> packed or padded host batches.

Every example is shifted once, before packing, into `inputs` = ids[:-1], `targets` =
ids[1:], `loss_mask` = mask[1:], so a target is always the next token *of the same
example* and packing can never make a row predict across an example boundary.

Pipeline (per host): examples[host's share] -> shuffle(seed, reshuffled every epoch) ->
repeat(num_epochs or forever) -> first-fit packing (grain, segment ids and positions per
example) or padding -> batch(batch_size // process_count) -> final names.
The iterator state is grain's: a small JSON-serialisable dict (`get_state`/`set_state`),
or pass the grain iterator (`.grain_iterator`) to `grain.checkpoint.CheckpointSave` in an
orbax Composite. With worker_count > 0 each grain worker packs its own share of the
examples, so the batch order differs from worker_count=0, but it is still fixed by the
seed and restored exactly from a saved state.

Batch: numpy arrays [per_host_batch, seq_len]: `inputs`, `targets` int32, `loss_mask`
float32 (0 on padding, prompts), `segment_ids` int32 (0 = padding, 1.. per example in the
row), `positions` int32 (restart at 0 per example); with `teacher`, also
`teacher_hidden` float16 [per_host_batch, seq_len, D]: the target's state at each token,
read from the memory-mapped states after packing (s2d_jax/data/teacher.py).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np

from s2d_jax.data import sources as data_sources
from s2d_jax.data.chat import VICUNA_SYSTEM, MalformedConversation, tokenize_conversation
from s2d_jax.data.teacher import TeacherStates
from s2d_jax.errors import S2DError

FORMATS = ("auto", "sharegpt", "text", "tokens", "corpus")
FEATURES = ("inputs", "targets", "loss_mask")
TEACHER_INDEX = "teacher_index"  # per token: its row of the teacher states (data.teacher)
_WARN_IDS = 5  # how many skipped row ids a warning names
# First-fit bins filled at once: grain emits all bins when one example fits in none, so
# few bins pack poorly. The emitted bins are then cut into host batches.
PACKING_BINS = 64


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # ShareGPT .json (list or single object) / .jsonl / .parquet, .txt, or token-id .jsonl
    paths: tuple[str, ...] = ()
    # auto | sharegpt | text | tokens (JSON lines {"input_ids": [...], "learn_from": n}:
    # ids as a model saw and produced them, loss on ids[n:], e.g. data/distill.py's rows)
    # corpus: data.paths are committed corpus folders (s2d_jax/data/corpus.py: token rows
    # in checksummed shards), every file verified before use
    format: str = "auto"
    corpus_shards: int = 0  # format corpus: the first N shards of each corpus (0 = all)
    tokenizer: str = "assets/llama2_tokenizer"
    seq_len: int = 512
    batch_size: int = 8  # global batch (all hosts)
    packing: bool = True  # pack several examples per row (segment ids) or pad each
    shuffle: bool = True
    seed: int = 0
    num_epochs: int = 0  # 0 = repeat forever
    system_prompt: str = ""  # "" = Vicuna default
    worker_count: int = 0
    # The target's states for the rows of the one tokens file (s2d_jax/data/teacher.py):
    # batches then carry `teacher_hidden` [B, T, D] for distillation (draft.kd_weight).
    teacher: str = ""

    def __post_init__(self):
        if isinstance(self.paths, (str, list)):  # YAML lists / a single path
            object.__setattr__(self, "paths", (self.paths,) if isinstance(self.paths, str)
                               else tuple(self.paths))
        if self.format not in FORMATS:
            raise S2DError(f"data.format={self.format!r} is not one of {', '.join(FORMATS)}")
        for f, lo in (("seq_len", 2), ("batch_size", 1), ("num_epochs", 0), ("worker_count", 0),
                      ("corpus_shards", 0)):
            if getattr(self, f) < lo:
                raise S2DError(f"data.{f} must be >= {lo}, got {getattr(self, f)}")
        if self.teacher and (self.format != "tokens" or len(self.paths) != 1):
            raise S2DError("data.teacher needs data.format=tokens and one file in data.paths "
                           "(the rows its states were computed from)")


@dataclasses.dataclass
class Examples:
    """Shifted examples (dicts of `FEATURES` arrays, each at most seq_len long) and counts."""

    examples: list[dict[str, np.ndarray]]
    stats: dict


def _shifted(ids, mask) -> dict[str, np.ndarray]:
    ids = np.asarray(ids, np.int32)
    return {"inputs": ids[:-1], "targets": ids[1:],
            "loss_mask": np.asarray(mask[1:], np.float32)}


def _clipped(ids, mask, limit: int, stats: dict):
    """(ids, mask) cut to `limit` tokens, or None (counted) when no learned token is left."""
    if len(ids) > limit:
        stats["truncated"] += 1
        ids, mask = ids[:limit], mask[:limit]
    if not any(mask[1:]):
        stats["no_learned_tokens"] += 1
        return None
    return ids, mask


def _corpus_rows(path: str, tok, shards: int, stats: dict) -> list[dict]:
    """The token rows of a committed corpus's first `shards` shards, every file verified;
    what was read goes to stats["data_slice"] (the run records it)."""
    from s2d_jax.data import corpus
    vocab = corpus.read_manifest(path)["target"].get("vocab_size")
    if vocab != tok.vocab_size:
        raise S2DError(f"corpus {path} holds ids of a {vocab}-token vocabulary, the tokenizer "
                       f"has {tok.vocab_size}; train with the corpus's target's tokenizer")
    rows, records = corpus.read_rows(path, shards)
    stats.setdefault("data_slice", []).append(corpus.data_slice(path, records))
    return rows


def _token_examples(path: str, tok, limit: int, stats: dict, teacher, rows=None):
    """Examples of a token-id .jsonl (loss on ids[learn_from:]), or of `rows` when given;
    with `teacher`, each carries its row's state indices (TeacherStates checked they are
    this very file's)."""
    if rows is None:
        rows = data_sources.load_token_rows(path, tok.vocab_size)
    for i, row in enumerate(rows):
        stats["rows"] += 1
        n = row["learn_from"]
        kept = _clipped(row["input_ids"], [0] * n + [1] * (len(row["input_ids"]) - n), limit,
                        stats)
        if kept is None:
            continue
        example = _shifted(*kept)
        if teacher is not None:  # row i's states, one per input position
            example[TEACHER_INDEX] = (teacher.offsets[i] + np.arange(
                len(example["inputs"]))).astype(np.int32)
        yield example


def _text_examples(path: str, tok, seq_len: int, stats: dict):
    """Windows of seq_len+1 tokens of each document, overlapping by one: every transition
    once; all tokens learned."""
    for doc in tok.encode_batch(data_sources.load_text_documents(path), bos=True):
        doc = doc + ([tok.eos_id] if tok.eos_id is not None else [])
        stats["rows"] += 1
        for s in range(0, max(len(doc) - 1, 0), seq_len):
            w = doc[s:s + seq_len + 1]
            yield _shifted(w, [1] * len(w))


def _chat_examples(path: str, tok, system: str, limit: int, stats: dict, skipped: list):
    """Examples of a ShareGPT file (loss on the assistant's tokens); malformed rows are
    counted and the first few named in `skipped`."""
    for i, row in enumerate(data_sources.load_records(path)):
        stats["rows"] += 1
        try:
            turns = row.get("conversations", row.get("messages")) if isinstance(row, dict) else None
            ids, mask = tokenize_conversation(tok, turns, system)
        except MalformedConversation as e:
            stats["malformed"] += 1
            if len(skipped) < _WARN_IDS:
                skipped.append(f"{data_sources.row_id(row, path, i)} ({e})")
            continue
        kept = _clipped(ids, mask, limit, stats)
        if kept is not None:
            yield _shifted(*kept)


def _file_examples(path: str, cfg: DataConfig, tok, stats: dict, skipped: list, teacher):
    limit = cfg.seq_len + 1  # tokens per example: seq_len inputs plus the last target
    if cfg.format == "tokens":
        return _token_examples(path, tok, limit, stats, teacher)
    if cfg.format == "corpus":
        return _token_examples(path, tok, limit, stats, None,
                               _corpus_rows(path, tok, cfg.corpus_shards, stats))
    if data_sources.file_format(path, cfg.format) == "text":
        return _text_examples(path, tok, cfg.seq_len, stats)
    return _chat_examples(path, tok, cfg.system_prompt or VICUNA_SYSTEM, limit, stats, skipped)


def build_examples(cfg: DataConfig, tok) -> Examples:
    """Tokenize every file of `cfg.paths`; malformed rows are counted, warned once, skipped."""
    if not cfg.paths:
        raise S2DError("data.paths is empty; give one or more ShareGPT .json/.jsonl/.parquet "
                       "or .txt files")
    stats = {"rows": 0, "malformed": 0, "no_learned_tokens": 0, "truncated": 0,
             "examples": 0, "tokens": 0, "learned_tokens": 0}
    skipped: list[str] = []
    teacher = TeacherStates(cfg.teacher, cfg.paths[0]) if cfg.teacher else None
    out = [example for path in cfg.paths
           for example in _file_examples(path, cfg, tok, stats, skipped, teacher)]
    stats["examples"] = len(out)
    stats["tokens"] = int(sum(len(e["inputs"]) for e in out))
    stats["learned_tokens"] = int(sum(e["loss_mask"].sum() for e in out))
    bad = stats["malformed"] + stats["no_learned_tokens"]
    if bad:
        warnings.warn(
            f"skipped {bad} of {stats['rows']} rows: {stats['malformed']} malformed"
            + (f" (first: {'; '.join(skipped)})" if skipped else "")
            + f", {stats['no_learned_tokens']} with no assistant token within "
              f"seq_len={cfg.seq_len}", stacklevel=2)
    if not out:
        raise S2DError(f"no usable training examples in {', '.join(cfg.paths)} "
                       f"({stats['rows']} rows, {bad} skipped); check the files' format")
    return Examples(out, stats)


def _pad(example: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    n = len(example["inputs"])
    padded = {k: np.pad(v, (0, seq_len - n)) for k, v in example.items()}
    padded["segment_ids"] = (np.arange(seq_len) < n).astype(np.int32)
    padded["positions"] = np.where(np.arange(seq_len) < n, np.arange(seq_len), 0).astype(np.int32)
    return padded


def _final_names(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """grain's packer names segment ids/positions per feature; keep the inputs' ones."""
    seg = batch.get("inputs_segment_ids", batch.get("segment_ids")).astype(np.int32)
    pos = batch.get("inputs_positions", batch.get("positions")).astype(np.int32)
    out = {"inputs": batch["inputs"].astype(np.int32),
           "targets": batch["targets"].astype(np.int32),
           "loss_mask": (batch["loss_mask"] * (seg > 0)).astype(np.float32),
           "segment_ids": seg, "positions": pos}
    if TEACHER_INDEX in batch:  # padding points at state 0, under loss_mask 0
        out[TEACHER_INDEX] = batch[TEACHER_INDEX].astype(np.int64)
    return out


class DataIterator:
    """A grain iterator of host batches with JSON-serialisable `get_state`/`set_state`."""

    # The state is this host's place in its own share of the examples: checkpoints keep
    # one per process, and only the same process count can continue it.
    state_per_process = True

    def __init__(self, dataset, cfg: DataConfig, stats: dict, per_host_batch: int):
        self.dataset, self.cfg, self.stats = dataset, cfg, stats
        self.per_host_batch = per_host_batch
        self.grain_iterator = iter(dataset)
        self._num_batches = None
        self.teacher = TeacherStates(cfg.teacher) if cfg.teacher else None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self.grain_iterator)
        if self.teacher is not None:  # read here, not packed: D numbers per token
            batch["teacher_hidden"] = self.teacher.gather(batch.pop(TEACHER_INDEX))
        return batch

    def get_state(self) -> dict:
        return self.grain_iterator.get_state()

    def set_state(self, state: dict) -> None:
        self.grain_iterator.set_state(state)

    def close(self) -> None:
        """Stop grain's worker processes (worker_count > 0) before interpreter exit."""
        close = getattr(self.grain_iterator, "close", None)
        if close is not None:
            close()

    @property
    def num_batches(self) -> int | None:
        """Batches per run on this host when num_epochs > 0 (one dry pass), else None."""
        if self.cfg.num_epochs == 0:
            return None
        if self._num_batches is None:
            self._num_batches = sum(1 for _ in iter(self.dataset))
        return self._num_batches


def make_dataset(examples: Examples, cfg: DataConfig, process_index: int, process_count: int):
    """The grain IterDataset of host batches (see the module docstring)."""
    import grain
    import grain.experimental as grain_exp

    if cfg.batch_size % process_count:
        raise S2DError(f"data.batch_size={cfg.batch_size} is not divisible by the "
                       f"{process_count} processes; use a multiple of it")
    if not 0 <= process_index < process_count:
        raise S2DError(f"process_index={process_index} is outside [0, {process_count})")
    per_host = cfg.batch_size // process_count
    ds = grain.MapDataset.source(examples.examples)
    # Equal shares: drop the few examples that do not divide among the hosts.
    usable = len(ds) - len(ds) % process_count
    if usable == 0:
        raise S2DError(f"{len(ds)} examples cannot be shared by {process_count} processes; "
                       "add data")
    ds = ds[:usable][process_index::process_count]
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(cfg.num_epochs or None)
    it = ds.to_iter_dataset()
    if cfg.packing:
        it = grain_exp.FirstFitPackIterDataset(
            it, length_struct={k: cfg.seq_len for k in examples.examples[0]},
            num_packing_bins=max(per_host, PACKING_BINS), seed=cfg.seed, shuffle_bins=cfg.shuffle)
    else:
        it = it.map(lambda e: _pad(e, cfg.seq_len))
    it = it.batch(per_host, drop_remainder=True).map(_final_names)
    if cfg.worker_count:
        from absl import flags
        # grain's worker pool reads an absl flag; our CLIs use argparse, so absl's flags
        # were never parsed and grain would raise UnparsedFlagAccessError. Use defaults.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    return it


def make_iterator(cfg: DataConfig, tok, process_index: int | None = None,
                  process_count: int | None = None) -> DataIterator:
    """Checkpointable iterator of this host's batches; process ids default to JAX's."""
    if process_index is None or process_count is None:
        import jax
        process_index, process_count = jax.process_index(), jax.process_count()
    examples = build_examples(cfg, tok)
    dataset = make_dataset(examples, cfg, process_index, process_count)
    return DataIterator(dataset, cfg, examples.stats, cfg.batch_size // process_count)


def load_iterator(cfg: DataConfig, process_index: int | None = None,
                  process_count: int | None = None) -> DataIterator:
    """`make_iterator` with the tokenizer of `cfg.tokenizer` (relative paths from the cwd)."""
    from s2d_jax.io.tokenizer import load_tokenizer
    return make_iterator(cfg, load_tokenizer(os.path.expanduser(cfg.tokenizer)),
                         process_index, process_count)
