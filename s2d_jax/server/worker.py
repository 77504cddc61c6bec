"""The thread that owns the device: it runs the slot engine's loop while there is work, and
the server's request handlers talk to it only through the engine's queue (submit) and
each job's sink and cancel flag.

A bounded wait list: `submit` refuses a request (QueueFull) when `max_queue` requests are
already waiting for a slot, so a server under overload answers 429 at once instead of
holding connections it cannot serve soon. `pause()` / `resume()` hold the loop between
chunks (a drain, or a test that needs the queue to fill).
"""

from __future__ import annotations

import logging
import threading
import time

from s2d_jax.errors import S2DError
from s2d_jax.server.request import Job, Request
from s2d_jax.server.slots import SlotEngine

log = logging.getLogger(__name__)


class QueueFull(S2DError):
    """The wait list is full: answer 429 with Retry-After."""


class Worker:
    """Runs `engine.step()` on one background thread while the engine is busy."""

    def __init__(self, engine: SlotEngine, max_queue: int = 64, background=None, say=None):
        """background: an iterator of warm-up pieces (warm_up.stages' rest), one run
        whenever the engine is idle, requests first; say(line) gets its progress."""
        from s2d_jax import validate
        self.engine = engine
        self.background, self.say = background, say or (lambda line: None)
        self.warming = "the rest of the warm-up" if background is not None else None
        self._warm_t0 = time.perf_counter()
        self.max_queue = validate.integer(max_queue, "max_queue", 1)
        self.wake = threading.Event()
        self.running = threading.Event()  # cleared: paused
        self.running.set()
        self.stopping = False
        self.counts = {"finished": 0, "cancelled": 0, "failed": 0}
        self._lock = threading.Lock()  # pending check + submit, so the bound holds
        self.thread = threading.Thread(target=self._loop, name="s2d-slot-engine", daemon=True)

    def start(self) -> "Worker":
        self.thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.stopping = True
        self.running.set()
        self.wake.set()
        self.thread.join(timeout)

    def pause(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()
        self.wake.set()

    def submit(self, request: Request, sink) -> Job:
        """Queue a request for the engine (handler threads) -> its Job; QueueFull when
        max_queue requests already wait; S2DError when the slots cannot hold it."""
        with self._lock:
            if self.engine.pending() >= self.max_queue:
                raise QueueFull(f"{self.engine.pending()} requests are waiting for a slot "
                                f"(at most {self.max_queue}); retry later")
            job = self.engine.submit(request, self._counting(sink))
        self.wake.set()
        return job

    def _counting(self, sink):
        def on_event(event):
            if event["type"] == "done":
                reason = event["result"].finish_reason
                self.counts["cancelled" if reason == "cancelled" else "finished"] += 1
            if sink is not None:
                sink(event)
        return on_event

    def _warm_a_piece(self) -> None:
        """One piece of the background warm-up (the engine is idle: no request waits)."""
        try:
            self.warming, _ = next(self.background)
            self.say(f"warming in the background: {self.warming} "
                     f"({time.perf_counter() - self._warm_t0:.0f} s)")
        except StopIteration:
            self.background = self.warming = None
            self.say(f"warm: every program compiled "
                     f"({time.perf_counter() - self._warm_t0:.0f} s in the background)")
        except Exception:  # a failed compile leaves those shapes to compile on demand
            log.exception("the background warm-up failed; programs compile on demand")
            self.background = self.warming = None

    def status(self) -> dict:
        e = self.engine
        policy = e.policy
        return {"state": "ready", "warming": self.warming, "slots": e.slots, "active": e.active(), "waiting": e.pending(),
                "rows": e.rows, "speculating": e.speculating,
                "tokens_per_round": None if policy is None else round(policy.tokens_per_round, 3),
                "max_queue": self.max_queue, "paused": not self.running.is_set(),
                **self.counts}

    def _loop(self) -> None:
        while not self.stopping:
            self.running.wait()
            if self.stopping:
                break
            if not self.engine.busy() and self.background is not None:
                self._warm_a_piece()
                continue
            if not self.engine.busy():
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:  # a failed chunk must not take the server down
                log.exception("the slot engine failed a chunk; its requests are failed")
                self.counts["failed"] += self.engine.fail_all(f"{type(e).__name__}: {e}")
