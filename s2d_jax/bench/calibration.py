"""The calibration's measuring harness: one target + its sorted draft on the calibration
prompts (`Calibration`), with the options of a run (`CalibrateOptions`). The search over
settings that uses it is calibration_search.py; the time model and the round replay are
calibrate.py."""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from s2d_jax.errors import S2DError

COST_SAMPLES = 5  # timed samples of every round-cost probe (medians)


@dataclasses.dataclass(frozen=True)
class CalibrateOptions:
    """A calibration run's settings (python -m infer.calibrate's flags, same names)."""
    draft: str
    questions: str = "data/demo_calibration.jsonl"
    max_prompts: int = 16
    categories: str | None = None  # comma-separated, None = all
    max_new_tokens: int = 128
    gammas: tuple[int, ...] = (2, 3, 4, 5, 6)
    check: int = 3  # best predicted multi-exit settings measured
    finalists: int = 4  # fastest settings measured a second time
    min_gain: float = 0.03  # settings within this fraction of the fastest count as equal
    repeats: int = 3
    cost_samples: int = COST_SAMPLES
    probe_rounds: int = 48
    cost_every: int = 1
    stops: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5)  # () = no draft stop tried
    chat_template: str = "auto"
    dtype: str | None = None  # None: as stored (load_model), as the commands' --dtype


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Calibration:
    """One target + draft on the calibration prompts: builds decoders, measures them
    against AR in one interleaved run, and holds the acceptance statistics and costs the
    predictions use (set by `measure_stats_and_costs`). `paper` is the setting the
    calibration is compared with: serving_config.resolve's uncalibrated S2D setting of
    this draft (0.5/.../0) at `paper_gamma`."""

    def __init__(self, opts: CalibrateOptions, name: str, path: str,
                 log: Callable[[str], None] = stderr_log):
        from s2d_jax.bench import runner as bench
        from s2d_jax.decode.serving_config import resolve

        self.opts, self.name, self.path, self.log = opts, name, path, log
        self.gammas = sorted(opts.gammas)
        # The paper's gamma, also the default one keeps unless another measurably pays.
        self.paper_gamma = 4 if 4 in self.gammas else self.gammas[len(self.gammas) // 2]
        self._load()
        self.paper = resolve("s2d", self.exits, None, gamma=self.paper_gamma)
        self._fit_buffer()
        self.ar_spec = bench.MethodSpec("ar", "ar", gamma=0)

    def _load(self) -> None:
        """The prompts, target, draft and the draft's exits."""
        from s2d_jax.data.prompts import (encode_questions, end_of_turn_id, read_questions,
                                          resolve_template)
        from s2d_jax.decode.defaults import draft_exits
        from s2d_jax.io.checkpoint import load_model
        from s2d_jax.io.checkpoint import load_draft
        from s2d_jax.io.tokenizer import load_tokenizer

        opts = self.opts
        cats = [c.strip() for c in opts.categories.split(",")] if opts.categories else None
        questions = read_questions(opts.questions, cats, opts.max_prompts)
        tok = load_tokenizer(self.path)
        template, note = resolve_template(tok, opts.chat_template)
        if note:
            self.log(note)
        self.prompts = encode_questions(tok, questions, template)
        self.eos = end_of_turn_id(tok, template)
        self.cfg, self.params, _ = load_model(self.path, dtype=opts.dtype)
        self.d_cfg, self.d_params, extra = load_draft(opts.draft, self.params,
                                                      dtype=opts.dtype)
        self.exits = draft_exits(extra, self.d_cfg)
        if len(self.exits) < 2:
            raise S2DError(f"draft {opts.draft} has a single exit; thresholds need a sorted "
                           f"draft with s2d_exits in its config.json")
        if self.d_cfg.vocab_size != self.cfg.vocab_size:
            raise S2DError(f"draft vocab_size {self.d_cfg.vocab_size} differs from the "
                           f"target's {self.cfg.vocab_size}; use a draft trained for this "
                           f"target")

    def _fit_buffer(self) -> None:
        """The padded prompt width and buffer length, which the largest gamma must fit."""
        from s2d_jax.decode.defaults import buffer_len, prompt_width

        new, g_max = self.opts.max_new_tokens, max(self.gammas)
        self.width = prompt_width(max(len(p) for p in self.prompts))
        need = self.width + new + g_max + 1
        self.max_len = buffer_len(self.width, new, g_max + 1,
                                  min(self.cfg.max_position_embeddings,
                                      self.d_cfg.max_position_embeddings))
        if need > self.max_len:
            raise S2DError(f"prompts of {self.width} tokens + {new} new tokens do not fit "
                           f"the context of {self.max_len}; lower --max-new-tokens")

    def build(self, specs) -> dict:
        from s2d_jax.bench import runner as bench
        return bench.build_decoders(list(specs), self.cfg, self.params, self.d_cfg,
                                    self.d_params, prompt_width=self.width)

    def run(self, decoders, repeats=None, between=None) -> dict:
        from s2d_jax.bench import runner as bench
        return bench.run_target(decoders, self.prompts, temperatures=[0.0],
                                max_new_tokens=self.opts.max_new_tokens,
                                max_len=self.max_len, eos_id=self.eos,
                                repeats=repeats or self.opts.repeats,
                                between=between)["runs"][0.0]

    def measure(self, decoders, probe_settings=()) -> dict:
        """label -> speedup vs AR (decoders["ar"], same run), exactness, MAT and the
        run's prefill seconds.

        probe_settings: (exits, gamma) of the settings measured; their round-cost probes
        and AR's are timed afresh after every cost_every-th prompt (so costs and runs see
        the same machine, as in the benchmark) and replace those settings' costs."""
        from s2d_jax.bench import calibrate
        keys = list(dict.fromkeys(calibrate.setting_key(e, g) for e, g in probe_settings))
        self.ensure_probes(keys)
        probes = [self.probes[k] for k in ["ar"] + keys] if keys else []
        for p in probes:
            p.reset()
        done = []

        def between():
            done.append(1)
            if probes and (len(done) % self.opts.cost_every == 0 or not probes[0].prefill_s):
                for p in probes:
                    p.sample()

        per = self.run(decoders, between=between)
        if keys:
            self.costs["ar"] = self.probes["ar"].result()
            self.costs["settings"].update({k: self.probes[k].result() for k in keys})
        return _speedups(per)

    def measure_stats_and_costs(self) -> None:
        from s2d_jax.bench import calibrate
        self.log(f"[{self.name}] greedy AR trajectories on {len(self.prompts)} prompts")
        ar = self.build([self.ar_spec])
        ar_runs = self.run(ar, repeats=1)["ar"]
        self.stats = calibrate.exit_stats(self.d_cfg, self.d_params, self.exits, self.prompts,
                                          [r["token_ids"] for r in ar_runs], self.max_len)
        # The benchmark's costs (loop_costs.py): the compiled prefill and round loop of AR,
        # of every single exit and of the whole set at every gamma, rounds forced to each
        # exit, timed inside the decode loop at the generation's buffer length; the other
        # subsets' costs follow from these (calibrate.derive_subset_costs).
        self.probes = {"ar": self.probe(ar["ar"])}
        keys = [calibrate.setting_key(sub, g) for sub in calibrate.probed_subsets(self.exits)
                for g in self.gammas]
        self.log(f"[{self.name}] timing rounds inside the decode loop: AR and {len(keys)} "
                 f"exit subset x gamma settings ({self.opts.probe_rounds} rounds per timing)")
        self.ensure_probes(keys, sample=False)
        for _ in range(self.opts.cost_samples):
            for p in self.probes.values():
                p.sample()
        probed = {key: p.result() for key, p in self.probes.items() if key != "ar"}
        self.costs = {"ar": self.probes["ar"].result(),
                      "settings": calibrate.derive_subset_costs(probed, self.exits,
                                                                self.gammas)}

    def ensure_probes(self, keys, sample: bool = True) -> None:
        """Compile a round-cost probe for every setting key without one (sampled
        cost_samples times unless `sample` is False), so a setting measured for real is
        predicted from its own costs, not derived ones."""
        from s2d_jax.bench import calibrate
        from s2d_jax.bench import runner as bench
        missing = [k for k in dict.fromkeys(keys) if k not in self.probes]
        if not missing:
            return
        specs = []
        for key in missing:
            sub, g = calibrate.parse_setting_key(key)
            specs.append(bench.MethodSpec(key, "s2d", sub, (0.0,) * len(sub), g))
        for key, dec in self.build(specs).items():
            self.probes[key] = self.probe(dec)
            if sample:
                self._sample(key)

    def _sample(self, key: str) -> None:
        for _ in range(self.opts.cost_samples):
            self.probes[key].sample()
        self.costs["settings"][key] = self.probes[key].result()

    def keep_probes(self, settings) -> None:
        """Free the compiled probes of settings no longer measured: each holds JIT code
        pages, and 60 probes plus the measured decoders exhausted LLVM's section memory
        ("Unable to allocate section memory") in one process. Their costs stay."""
        import gc

        import jax
        from s2d_jax.bench import calibrate
        keep = {"ar"} | {calibrate.setting_key(e, g) for e, g in settings}
        self.probes = {k: p for k, p in self.probes.items() if k in keep}
        jax.clear_caches()
        gc.collect()

    def probe(self, decoder):
        from s2d_jax.bench.loop_costs import LoopProbe
        return LoopProbe(decoder, self.prompts[0], max_len=self.max_len,
                         rounds=self.opts.probe_rounds)

    def add_one_step_costs(self, decoder, exits, gamma) -> None:
        """Round costs of a decoder with a draft stop (its probe also times one-step
        rounds), for predictions of that setting with a stop."""
        from s2d_jax.bench import calibrate
        key = calibrate.setting_key(exits, gamma)
        self.probes[key] = self.probe(decoder)
        self._sample(key)

    def predicted(self, thresholds, gamma, exits, stop=0.0, measured=None) -> dict:
        """{"predicted_speedup", "predicted_mat"} of a setting (None each without drafts);
        `measured`: (the setting's, AR's) prefill seconds in the run it is compared with."""
        from s2d_jax.bench import calibrate
        pre, ar_pre = measured or (None, None)
        p = calibrate.predict_config(self.stats, self.costs, thresholds, gamma, exits, stop,
                                     prefill_s=pre, ar_prefill_s=ar_pre)
        return {"predicted_speedup": p["predicted_speedup"] if p else None,
                "predicted_mat": p["mean_accepted_tokens"] if p else None}


def _speedups(per: dict) -> dict:
    """label -> {"speedup" vs AR, "exact" (AR's tokens), "mat", "prefill_s"} of one run."""
    from s2d_jax.bench import runner as bench
    ar_tps = bench._aggregate(per["ar"])["tokens_per_second"]
    out = {}
    for label, rows in per.items():
        agg = bench._aggregate(rows)
        exact = all(r["token_ids"] == a["token_ids"] for r, a in zip(rows, per["ar"]))
        out[label] = {"speedup": agg["tokens_per_second"] / ar_tps, "exact": exact,
                      "mat": agg["mean_accepted_tokens"], "prefill_s": agg["prefill_seconds"]}
    return out
