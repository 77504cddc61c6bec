"""A server from model paths: load the decoder (decode/chat.load_decoder: the same
settings as `generate` and `chat`), build and warm the slot engine, start the worker, and
run uvicorn, in the foreground (`run`, what `python -m infer.serve` and `s2d_jax.serve`
do) or on a thread (`start`, for tests and notebooks).
"""

from __future__ import annotations

import threading
import time

from s2d_jax.errors import S2DError


class Server:
    """A warmed engine, its worker thread and the HTTP app on host:port."""

    def __init__(self, engine, *, model: str, template: str, host: str = "127.0.0.1",
                 port: int = 8000, max_queue: int = 64, default_max_tokens: int = 256):
        from s2d_jax import validate
        from s2d_jax.server.app import make_app
        from s2d_jax.server.worker import Worker
        self.engine, self.host = engine, validate.text(host, "host")
        self.port = validate.integer(port, "port", 0, 65535)
        self.worker = Worker(engine, max_queue=max_queue)
        self.app = make_app(self.worker, model=model, tokenizer=engine.tok, template=template,
                            default_max_tokens=default_max_tokens)
        self.model = model
        self._uvicorn = None
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _make_uvicorn(self, log_level: str, own_logging: bool = True):
        """own_logging False: leave the process's logging as it is (uvicorn's dictConfig
        would replace its handlers: a server on a thread lives beside other code)."""
        import uvicorn
        kw = {} if own_logging else {"log_config": None}
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level=log_level,
                                timeout_graceful_shutdown=5, **kw)
        self._uvicorn = uvicorn.Server(config)
        return self._uvicorn

    def run(self, log_level: str = "info") -> None:
        """Serve in the foreground until interrupted."""
        self.worker.start()
        try:
            self._make_uvicorn(log_level).run()
        finally:
            self.worker.stop()

    def start(self, log_level: str = "warning", timeout: float = 60.0) -> "Server":
        """Serve on a background thread; returns once it accepts connections (port 0:
        a free port, then in self.port)."""
        server = self._make_uvicorn(log_level, own_logging=False)
        self.worker.start()
        self._thread = threading.Thread(target=server.run, name="s2d-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise S2DError(f"the server did not start on {self.host}:{self.port}; is the "
                               f"port free?")
            time.sleep(0.02)
        self.port = server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self.worker.stop()


def build_server(target: str, draft: str | None = None, *, method: str = "s2d",
                 name: str | None = None, gamma: int | None = None, thresholds=None,
                 exit: int | None = None, exits=None, dtype: str | None = None,
                 chat_template: str = "auto", slots: int = 8, max_len: int | None = None,
                 chunk_rounds: int = 4, max_queue: int = 64, default_max_tokens: int = 256,
                 host: str = "127.0.0.1", port: int = 8000, seed: int = 0,
                 progress=None) -> Server:
    """Load, build and warm (compiles every program: see SlotEngine.warm) -> a Server not
    yet started. `progress(line)` gets a line per stage."""
    import os

    from s2d_jax import validate
    from s2d_jax.data.prompts import end_of_turn_id, resolve_template
    from s2d_jax.decode.chat import load_decoder
    from s2d_jax.server.slots import SlotEngine

    say = progress or (lambda line: None)
    validate.choice(chat_template, "chat_template", ("auto", "vicuna", "none"))
    validate.text(name, "name", optional=True)
    decoder, tok, notes = load_decoder(target, draft, method=method, gamma=gamma,
                                       thresholds=thresholds, exit=exit, exits=exits,
                                       dtype=dtype)
    template, note = resolve_template(tok, chat_template)
    for line in notes + ([note] if note else []):
        say(line)
    engine = SlotEngine(decoder, tok, slots=slots, max_len=max_len, chunk_rounds=chunk_rounds,
                        eos_id=end_of_turn_id(tok, template), seed=seed)
    t0 = time.perf_counter()
    warmed = engine.warm()
    say(f"warmed {sum(warmed.values())} programs in {time.perf_counter() - t0:.1f} s "
        f"({', '.join(f'{k} x{v}' for k, v in warmed.items())}; prompt widths "
        f"{', '.join(map(str, engine.buckets))}; {slots} slots of {engine.max_len} tokens)")
    if engine.policy is not None:
        say("round seconds per row bucket (speculative / AR -> the tokens per round "
            "speculation needs): " + ", ".join(
                f"{r['rows']}: {r['spec_round_s'] * 1e3:.0f} / {r['ar_round_s'] * 1e3:.0f} ms "
                f"-> {r['break_even_tokens_per_round']:.2f}" for r in engine.policy.table()))
    model = name or os.path.basename(os.path.normpath(target))
    return Server(engine, model=model, template=template, host=host, port=port,
                  max_queue=max_queue, default_max_tokens=default_max_tokens)
