"""The slot engine: continuous batching over a fixed number of decode slots, on the
engine's own jitted programs (decode/engine.py), for every method (ar, sd, self, s2d,
lookup, ladder, polybasic chains).

    engine = SlotEngine(decoder, tokenizer, slots=4, max_len=512)
    engine.warm()                        # compiles every program the requests will need
    job = engine.submit(Request(ids, max_new_tokens=64), sink=print)
    while engine.busy(): engine.step()   # or server.worker.Worker: a thread owning the device
    job.result                           # Result: token_ids, text, finish_reason, stats

One batch state lives on the device, with as many rows as the smallest row bucket
(`row_buckets`: powers of two up to `slots`) that holds the busy slots, which stay at
the front: a round computes every row of the batch, so one request alone decodes at
batch 1, not at `slots`. A request is prefilled alone (engine.prefill_caches at batch 1,
its prompt padded to a width bucket; engine.start draws its first token, so a request with
the prompt of the one before reuses its caches) and written into the first free row
(programs.insert),
the batch growing to the next bucket when it is full (programs.resize); `step()` then
runs one chunk of `chunk_rounds` rounds for every busy row (engine.decode_chunk: rows of
different lengths, ragged acceptance, each at its own positions), reads back the tokens
and hands each request its new text. A request that ended (EOS, its budget, a stop
string) or was cancelled frees its row between chunks (programs.release), the last busy
row moves into the hole (programs.move) and the batch shrinks to the bucket that holds
the rest; a waiting request takes the room first. A row's computation never reads
another row (attention, the cache and the accept rule are per row; the CPU kernels
compute a row the same whatever the row count), so a greedy answer is the one the
prompt gets alone.

Speculation that adapts to load (server/occupancy.py): for a two-level method (sd, s2d,
self, lookup, ladder) `warm()` measures the round cost of the method's chunk and of a
plain AR chunk at every row bucket, and each chunk runs the one with more expected
tokens a second at the current bucket, with the tokens per round the traffic gets. An
AR chunk decodes the target alone on the same state (the draft's cache is set aside and
falls behind), and a request admitted while the batch decodes AR is prefilled without
the draft; before the next speculative chunk the draft catches up on the tokens it
missed (programs.catch_up_draft). Either program commits the target's own tokens, so
the answers do not depend on the choice.

Per row: max_new_tokens, temperature and top_p are traced arrays (a setting never
recompiles). Compiled programs, all made by `warm()`: prefill once per prompt-width
bucket (`buckets`: width_buckets) and the first token's draw once (both twice with a
draft: with and without it); per row
bucket insert (of both prefills), release,
move, the draft's catch-up and the chunk twice per program (the greedy one, which skips
the softmaxes, whenever every busy row is greedy; the sampling one otherwise); a resize
per pair of row buckets. The first token's draw always runs the sampling program: at
temperature 0 it draws the argmax, so one program serves both.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.decode.defaults import PROMPT_BUCKET
from s2d_jax.decode.sampling import SamplingParams
from s2d_jax.decode.state import DecodeParams
from s2d_jax.errors import S2DError
from s2d_jax.server import programs
from s2d_jax.server.occupancy import OccupancyPolicy
from s2d_jax.server.request import Job, Request, Result, speculation_stats
from s2d_jax.server.text import AnswerText
from s2d_jax import validate


# Past this width prompt widths grow by it, not by doubling: a long prefill is bound by
# its multiply-adds, so every padded position is paid in full (a 700-token prompt padded
# to 1024 would cost 46% more), while each width is one more program to compile.
LONG_PROMPT_STEP = 256


def width_buckets(max_len: int, growth: float | None = None) -> tuple[int, ...]:
    """Padded prompt widths: powers of two from PROMPT_BUCKET up to 2 * LONG_PROMPT_STEP,
    then steps of LONG_PROMPT_STEP, the last one max_len (a prompt needs a slot for at
    least one new token: it is shorter than max_len). With `growth` (the corpus
    generator's, where compiles are paid once for hours of prefills), each width is at
    most that fraction above the one before, in multiples of PROMPT_BUCKET: 0.25 pads
    magpie0's prompts by 10% where powers of two pad them by 50%."""
    if growth is not None and not 0 < growth <= 1:
        raise S2DError(f"width growth {growth} must be in (0, 1]")
    widths, w = [], PROMPT_BUCKET
    while w < max_len:
        widths.append(w)
        if growth is not None:
            w += PROMPT_BUCKET * max(1, int(w * growth) // PROMPT_BUCKET)
        else:
            w = w * 2 if w < 2 * LONG_PROMPT_STEP else w + LONG_PROMPT_STEP
    return tuple(widths) + (max_len,)


def row_buckets(slots: int) -> tuple[int, ...]:
    """Batch sizes the engine runs at: powers of two below `slots`, then `slots`."""
    rows, r = [], 1
    while r < slots:
        rows.append(r)
        r *= 2
    return tuple(rows) + (slots,)


class SlotEngine:
    """Continuous batching over `slots` decode slots of `max_len` tokens each (prompt +
    answer) for one Decoder; see the module docstring. Not thread-safe except `submit`,
    `pending` and Job.cancel: one thread (server.worker.Worker) calls step()."""

    def __init__(self, decoder, tokenizer, *, slots: int = 4, max_len: int | None = None,
                 chunk_rounds: int = 4, eos_id: int | None = None, seed: int = 0,
                 adaptive: bool = True, width_growth: float | None = None):
        from s2d_jax.decode.defaults import eos_id_or_default
        validate.integer(slots, "slots", 1)
        validate.integer(chunk_rounds, "chunk_rounds", 1)
        validate.integer(max_len, "max_len", 2, optional=True)
        context = decoder.context
        max_len = context if max_len is None else max_len
        if max_len > context:
            raise S2DError(f"max_len {max_len} is past the models' context of {context} "
                           f"positions; pass max_len <= {context}")
        self.decoder, self.tok = decoder, tokenizer
        self.slots, self.max_len, self.chunk_rounds = slots, max_len, chunk_rounds
        self.chain = decoder.chain.with_max_len(max_len)
        self.spec = self.chain.spec
        self.buckets = width_buckets(max_len, width_growth)
        self.eos_id = eos_id_or_default(eos_id, decoder.target_cfg)
        self.draft_params = programs.split_draft(decoder.draft_params, chain=self.chain) \
            if decoder.draft_params is not None else None
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.waiting: collections.deque[Job] = collections.deque()
        self.jobs: list[Job | None] = [None] * slots  # busy rows first (`_compact`)
        self.row_buckets = row_buckets(slots)
        self.seed = seed
        # the plain-AR alternative of a two-level speculative method (module docstring);
        # the policy that picks between them exists once warm() measured their costs
        two_level = self.spec.proposer.proposes and not self.spec.mus
        self.ar = programs.ar_chain(self.chain) if adaptive and two_level else None
        self.policy: OccupancyPolicy | None = None
        self.speculating = self.spec.proposer.proposes  # what the last chunk ran
        self.draft_stale = False  # AR chunks ran since the draft's cache was current
        self.seen = np.zeros((slots, 2), np.int64)  # per row: rounds, tokens last read
        self.chunks = collections.Counter()  # chunks run: speculative / ar
        self.rows = self.row_buckets[0]
        self._empty_shapes: dict = {}  # rows -> the batch state's shapes (_empty)
        self.state = self._empty(self.rows)
        self.prefilled = None  # ((prompt ids, draft), engine.prefill_caches output): _prefill

    def _empty(self, rows: int):
        shapes = self._empty_shapes.get(rows)  # the same every time: found once
        if shapes is None:
            args = self._prefill_args(np.ones((rows, self.buckets[0]), np.int32),
                                      np.ones(rows, np.int32), self._request_dp(Request((1,))),
                                      self.seed)
            shapes = self._empty_shapes[rows] = programs.empty_shapes(args, chain=self.chain)
        return programs.empty_from(shapes)

    # --- what the programs take -------------------------------------------------------

    def _request_dp(self, r: Request) -> DecodeParams:
        """A request's settings for its prefill (scalars; the sampling program always)."""
        dp = self.decoder.decode_params(self.spec, temperature=r.temperature, top_p=r.top_p,
                                        max_new_tokens=r.max_new_tokens, eos_id=self.eos_id,
                                        stop_threshold=self.decoder.stop_threshold)
        return dp.replace(sampling=dataclasses.replace(dp.sampling, greedy=False))

    def _batch_dp(self, spec=None) -> DecodeParams:
        """The chunk's settings for `spec` (default the method's): each row's budget,
        temperature and top-p ([rows] arrays); free rows are done, their values unused."""
        spec = spec or self.spec
        jobs = [(j.request if j is not None else None) for j in self.jobs[:self.rows]]
        new = np.array([r.max_new_tokens if r else 1 for r in jobs], np.int32)
        temp = np.array([r.temperature if r else 0.0 for r in jobs], np.float32)
        top_p = np.array([r.top_p if r else 1.0 for r in jobs], np.float32)
        greedy = all(r is None or r.greedy for r in jobs)
        sp = SamplingParams(jax.device_put(temp), jnp.int32(0), jax.device_put(top_p),
                            greedy=greedy)
        thresholds = (np.asarray(self.decoder.thresholds, np.float32).reshape(spec.num_exits)
                      if spec.num_exits else np.zeros(0, np.float32))
        return DecodeParams(sp, jax.device_put(thresholds), jax.device_put(new),
                            jnp.int32(self.eos_id), jnp.float32(self.decoder.stop_threshold))

    def _prefill_args(self, arr, lens, dp, seed, draft: bool = True) -> tuple:
        d = self.decoder
        return (self.draft_params if draft else None, d.target_params, jax.device_put(arr), jax.device_put(lens),
                dp, jax.random.key(seed), d.mid_params)

    def _loop_args(self, dp, draft: bool = True) -> tuple:
        d = self.decoder
        return (self.draft_params if draft else None, d.target_params, dp,
                jnp.int32(self.chunk_rounds), d.mid_params)

    # --- requests ---------------------------------------------------------------------

    def check(self, r: Request) -> None:
        """Refuse a request the slots cannot hold (one line naming the fix)."""
        n, V = len(r.prompt_ids), self.decoder.target_cfg.vocab_size
        if max(r.prompt_ids) >= V:
            raise S2DError(f"the prompt has token ids outside [0, {V}); wrong tokenizer?")
        if n >= self.max_len:
            raise S2DError(f"the prompt has {n} tokens; this server holds {self.max_len} "
                           f"tokens per request (prompt + answer): shorten the prompt")
        if n + r.max_new_tokens > self.max_len:
            raise S2DError(f"max_tokens {r.max_new_tokens} after a prompt of {n} tokens is "
                           f"past the {self.max_len} tokens per request; ask for at most "
                           f"{self.max_len - n}")

    def submit(self, request: Request, sink: Callable[[dict], None] | None = None) -> Job:
        """Queue a request (any thread) -> its Job."""
        if not isinstance(request, Request):
            raise S2DError(f"submit takes a Request, got {type(request).__name__}")
        self.check(request)
        job = Job(request, sink)
        self.inbox.put(job)
        return job

    def pending(self) -> int:
        """Requests submitted and not yet in a slot."""
        return self.inbox.qsize() + len(self.waiting)

    def active(self) -> int:
        return sum(j is not None for j in self.jobs)

    def busy(self) -> bool:
        return self.active() > 0 or self.pending() > 0

    # --- the loop ---------------------------------------------------------------------

    def step(self) -> None:
        """Admit waiting requests into free slots, run one chunk, hand out the text, free
        the slots of requests that ended (one call: one chunk)."""
        while True:
            try:
                self.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        self._drop_cancelled()
        self._admit()
        if not self.active():
            return
        self._resize(self._bucket(self.active()))
        self.speculating = self.ar is None or self.policy is None or \
            self.policy.choose(self.rows)
        self._chunk(self.speculating)
        self.chunks["speculative" if self.speculating and self.spec.proposer.proposes
                    else "ar"] += 1
        self._collect()

    def _chunk(self, speculate: bool) -> None:
        """One chunk of the method's program (speculate) or of plain AR on the same state
        (module docstring)."""
        if speculate:
            if self.draft_stale:
                self.state = programs.catch_up_draft(self.state, self.draft_params,
                                                     chain=self.chain)
                self.draft_stale = False
            self.state = programs.decode_chunk(self.state, *self._loop_args(self._batch_dp()),
                                               chain=self.chain)
            return
        stats, draft_cache = self.state.stats, self.state.draft_cache
        out = programs.decode_chunk(programs.without_draft(self.state, self.ar),
                                    *self._loop_args(self._batch_dp(self.ar.spec), draft=False),
                                    chain=self.ar)
        self.state = programs.with_draft(out, stats, draft_cache)
        self.draft_stale = draft_cache is not None

    def _bucket(self, busy: int) -> int:
        return next(r for r in self.row_buckets if r >= max(busy, 1))

    def _resize(self, rows: int) -> None:
        """Run the batch at `rows` rows (the busy ones are at the front)."""
        if rows != self.rows:
            self.state = programs.resize(self.state, rows=rows, chain=self.chain)
            self.rows = rows

    def _compact(self) -> None:
        """Move the last busy rows into the holes before them (one row copy each)."""
        while True:
            busy = [b for b, j in enumerate(self.jobs) if j is not None]
            holes = [b for b in range(len(busy)) if self.jobs[b] is None]
            if not holes:
                return
            src, dst = busy[-1], holes[0]
            self.state = programs.move(self.state, jnp.int32(src), jnp.int32(dst),
                                       chain=self.chain)
            self.jobs[dst], self.jobs[src] = self.jobs[src], None
            self.jobs[dst].slot = dst
            self.seen[dst] = self.seen[src]

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.waiting if j.cancelled.is_set()]:
            self.waiting.remove(job)
            self._finish(job, [], "cancelled", (0, 0, 0))
        free = np.zeros(self.slots, bool)
        for b, job in enumerate(self.jobs):
            if job is not None and job.cancelled.is_set():
                free[b] = True
                self._finish_slot(b, "cancelled")
        if free.any():
            self.state = programs.release(self.state, jax.device_put(free[:self.rows]),
                                          chain=self.chain)
            self._compact()

    def _admit(self) -> None:
        while self.waiting and None in self.jobs:
            job = self.waiting.popleft()
            draft = self._draft_on_admit()
            one = self._prefill(job.request, draft)
            tokens, length, prompt_len, done = jax.device_get(
                (one.tokens, one.length, one.prompt_len, one.done))
            job.first_token_at = time.perf_counter()
            job.text = AnswerText(self.tok, job.request.stop)
            if self._advance(job, tokens[0, prompt_len[0]:length[0]], bool(done[0])):
                continue  # ended with its first token: no slot needed
            b = self.jobs.index(None)  # == self.active(): busy rows are at the front
            if b >= self.rows:
                self._resize(self._bucket(b + 1))
            self.state = programs.insert(self.state, one, jnp.int32(b), chain=self.chain)
            self.jobs[b], job.slot = job, b
            self.seen[b] = 0
            self.draft_stale |= not draft

    def _draft_on_admit(self) -> bool:
        """Whether a request admitted now gets the draft's prefill: not while the batch it
        joins decodes plain AR (the draft's share of a long prompt's prefill would be
        paid for nothing; the catch-up reads the prompt if speculation resumes)."""
        if self.ar is None or self.draft_params is None or self.policy is None:
            return True
        return self.policy.speculate(self._bucket(self.active() + 1))

    def _prefill(self, r: Request, draft: bool = True):
        """The request's one-row state after its first token. The prompt's caches are
        kept while the next waiting request has the same prompt (a corpus prompt at two
        temperatures), which then only draws its own first token."""
        chain = self.chain if draft else self.ar
        key = (r.prompt_ids, draft)
        if self.prefilled is None or self.prefilled[0] != key:
            self.prefilled = None  # (its memory goes before the next prefill's)
            self.prefilled = (key, self._prefill_caches(r.prompt_ids, draft))
        one = programs.start(*self.prefilled[1], jax.device_put(np.array([len(r.prompt_ids)],
                                                                           np.int32)),
                             self._request_dp(r), jax.random.key(r.seed), chain=chain)
        if not (self.waiting and self.waiting[0].request.prompt_ids == r.prompt_ids):
            self.prefilled = None
        return one

    def _prefill_caches(self, prompt_ids, draft: bool = True, width: int | None = None):
        """engine.prefill_caches of one prompt, padded to its width bucket (or `width`)."""
        n = len(prompt_ids)
        width = width or next(w for w in self.buckets if w >= n)
        arr = np.zeros((1, width), np.int32)
        arr[0, :n] = prompt_ids
        d = self.decoder
        return programs.prefill_caches(self.draft_params if draft else None, d.target_params,
                                       jax.device_put(arr),
                                       jax.device_put(np.array([n], np.int32)),
                                       d.mid_params, chain=self.chain if draft else self.ar)

    def _collect(self) -> None:
        s = self.state
        tokens, length, prompt_len, done, stats = jax.device_get(
            (s.tokens, s.length, s.prompt_len, s.done, s.stats))
        self._observe(stats)
        free = np.zeros(self.slots, bool)
        for b, job in enumerate(self.jobs):
            if job is None:
                continue
            counts = (int(stats.rounds[b]), int(np.sum(stats.proposed_at[b])),
                      int(np.sum(stats.accepted_at[b])))
            if self._advance(job, tokens[b, prompt_len[b]:length[b]], bool(done[b]), counts):
                free[b] = not done[b]  # stopped by a stop string: the row still runs
                self.jobs[b] = None
        if free.any():
            self.state = programs.release(self.state, jax.device_put(free[:self.rows]),
                                          chain=self.chain)
        self._compact()

    def _observe(self, stats) -> None:
        """The busy rows' rounds and tokens since the last read; a speculative chunk's
        go to the policy's tokens per round."""
        busy = np.array([j is not None for j in self.jobs[:self.rows]])
        now = np.stack([stats.rounds, stats.round_tokens], axis=1).astype(np.int64)
        delta = (now - self.seen[:self.rows])[busy]
        self.seen[:self.rows] = now
        if self.policy is not None and self.speculating:
            self.policy.observe(int(delta[:, 1].sum()), int(delta[:, 0].sum()))

    def _advance(self, job: Job, ids, done: bool, counts=(0, 0, 0)) -> bool:
        """The job's answer is now `ids` (done: its row stopped) -> it ended."""
        ids = [int(i) for i in ids]
        delta, stopped = job.text.update(ids, final=done)
        if delta:
            job.emit({"type": "text", "text": delta})
        if stopped:
            self._finish(job, ids[:job.text.stop_at_token], "stop", counts)
        elif done:
            hit_eos = bool(ids) and ids[-1] == self.eos_id
            self._finish(job, ids, "stop" if hit_eos else "length", counts)
        return stopped or done

    def _finish_slot(self, b: int, reason: str) -> None:
        job = self.jobs[b]
        s = self.state
        tokens, length, prompt_len, stats = jax.device_get(
            (s.tokens, s.length, s.prompt_len, s.stats))
        self.jobs[b] = None
        self._finish(job, tokens[b, prompt_len[b]:length[b]].tolist(), reason,
                     (int(stats.rounds[b]), int(np.sum(stats.proposed_at[b])),
                      int(np.sum(stats.accepted_at[b]))))

    def _finish(self, job: Job, ids: list[int], reason: str, counts) -> None:
        rounds, drafted, accepted = counts
        text = job.text.text if job.text is not None else ""
        job.result = Result(list(ids), text, reason,
                            speculation_stats(len(ids), rounds, drafted, accepted),
                            len(job.request.prompt_ids))
        job.finished.set()
        job.emit({"type": "done", "result": job.result})

    def fail_all(self, message: str) -> int:
        """After a failed chunk (its donated state is gone): every job in a slot gets
        {"type": "error", "message"} and the slots start empty -> how many failed. Waiting
        jobs stay queued."""
        failed = [j for j in self.jobs if j is not None]
        for job in failed:
            job.result = Result([], "", "error", {}, len(job.request.prompt_ids))
            job.finished.set()
            job.emit({"type": "error", "message": message})
        self.jobs = [None] * self.slots
        self.rows, self.draft_stale = self.row_buckets[0], False
        self.state = self._empty(self.rows)
        return len(failed)

    # --- warm-up and the API's batch --------------------------------------------------

    def warm(self) -> dict:
        """Compile every program a request can need (module docstring), so no request
        compiles, and measure the round costs the occupancy policy reads -> {program:
        count} of what was compiled (server/warm_up.py)."""
        from s2d_jax.server.warm_up import warm
        return warm(self)

    def run(self, requests, sinks=None) -> list[Result]:
        """Decode `requests` to the end on this thread -> one Result each, in order."""
        sinks = sinks or [None] * len(requests)
        jobs = [self.submit(r, s) for r, s in zip(requests, sinks)]
        while not all(j.finished.is_set() for j in jobs):
            self.step()
        return [j.result for j in jobs]
