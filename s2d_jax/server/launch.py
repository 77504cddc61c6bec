"""A server from model paths: bind its port (listen.py: a port in use fails before
anything loads), load the decoder (decode/chat.load_decoder: the same settings as
`generate` and `chat`), build and warm the slot engine, start the worker, and run uvicorn
on the bound socket, in the foreground (`run`, what `python -m infer.serve` and
`s2d_jax.serve` do) or on a thread (`start`, for tests and notebooks).
"""

from __future__ import annotations

import os
import threading
import time

from s2d_jax.errors import S2DError
from s2d_jax.server.body import DEFAULT_MAX_BODY_BYTES


class Server:
    """A warmed engine, its worker thread and the HTTP app on host:port (`sock`: a socket
    listen.bind made for them; None: bound here)."""

    def __init__(self, engine, *, model: str, template: str, host: str = "127.0.0.1",
                 port: int = 8000, max_queue: int = 64, default_max_tokens: int = 128,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, sock=None, background=None,
                 say=None):
        """background: warm-up pieces the worker runs while idle (launch.warm_first's
        rest); say(line): where it reports them."""
        from s2d_jax import validate
        from s2d_jax.server.app import make_app
        from s2d_jax.server.listen import bind
        from s2d_jax.server.worker import Worker
        self.engine, self.host = engine, validate.text(host, "host")
        port = validate.integer(port, "port", 0, 65535)
        self.max_body_bytes = validate.integer(max_body_bytes, "max_body_bytes", 1,
                                               hi=1 << 62)
        self.worker = Worker(engine, max_queue=max_queue, background=background, say=say)
        self.app = make_app(self.worker, model=model, tokenizer=engine.tok, template=template,
                            default_max_tokens=default_max_tokens,
                            max_body_bytes=self.max_body_bytes)
        self.model = model
        self.sock = sock if sock is not None else bind(self.host, port)
        self.port = self.sock.getsockname()[1]
        self._uvicorn = None
        self._thread = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
        return f"http://{host}:{self.port}"

    def _make_uvicorn(self, log_level: str, own_logging: bool = True):
        """own_logging False: leave the process's logging as it is (uvicorn's dictConfig
        would replace its handlers: a server on a thread lives beside other code)."""
        import uvicorn
        kw = {"log_config": _log_config()} if own_logging else {"log_config": None}
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level=log_level,
                                timeout_graceful_shutdown=5, **kw)
        self._uvicorn = uvicorn.Server(config)
        return self._uvicorn

    def run(self, log_level: str = "info") -> None:
        """Serve in the foreground until interrupted (SIGINT / SIGTERM: uvicorn finishes
        the requests in flight, up to 5 s, then raises the signal again)."""
        self.worker.start()
        try:
            self._make_uvicorn(log_level).run(sockets=[self.sock])
        finally:
            self.worker.stop()

    def start(self, log_level: str = "warning", timeout: float = 60.0) -> "Server":
        """Serve on a background thread; returns once it accepts connections."""
        server = self._make_uvicorn(log_level, own_logging=False)
        self.worker.start()
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]},
                                        name="s2d-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise S2DError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self.worker.stop()
        self.sock.close()


def _log_config() -> dict:
    """uvicorn's logging, with this package's server lines (a client that left, a prompt the
    tokenizer refused) through its handler: logging's own default drops INFO lines."""
    import copy

    from uvicorn.config import LOGGING_CONFIG
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["s2d_jax.server"] = {"handlers": ["default"], "level": "INFO",
                                           "propagate": False}
    return config


def serve_early(sock, model: str, progress, log_level: str = "info",
                **build_kw) -> tuple[bool, bool]:
    """Serve on `sock` from the first second: uvicorn on this thread answers /health with
    the warm-up's state (gate.py) while a helper thread loads and warms (build_server),
    then serves the real app. Returns once stopped by SIGINT / SIGTERM (uvicorn's graceful
    stop) -> (whether it got ready, whether a thread may still be compiling inside XLA:
    the caller then exits the process rather than wait); a failed build is raised here."""
    import uvicorn

    from s2d_jax.server.gate import Gate
    gate, out = Gate(model), {}
    config = uvicorn.Config(gate, log_level=log_level, log_config=_log_config(),
                            lifespan="off", timeout_graceful_shutdown=5)
    http = uvicorn.Server(config)

    def say(line):
        gate.say(line)
        progress(line)

    def build():
        try:
            server = build_server(sock=sock, progress=say, **build_kw)
            server.worker.start()
            out["server"] = server
            gate.open(server.app)
            say(f"serving {model} on {server.url}/v1")
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e
            http.should_exit = True

    helper = threading.Thread(target=build, name="s2d-build", daemon=True)
    helper.start()
    try:
        http.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the stopping signal again once it stopped
        pass
    finally:
        if "server" in out:
            out["server"].worker.stop(2)
    if "error" in out:
        raise out["error"]
    server = out.get("server")
    return server is not None, helper.is_alive() or (
        server is not None and server.worker.thread.is_alive())


def build_interruptibly(*args, **kw) -> Server:
    """build_server(*args, **kw) on a helper thread, the main thread waiting in short joins:
    Python runs a signal's handler on the main thread between bytecodes only, and XLA holds
    a compiling thread for seconds at a time, so a SIGTERM (KeyboardInterrupt under
    errors.cli_main) during the warm-up would wait for it. Raised there, it leaves the
    helper compiling: the caller exits the process (os._exit) rather than wait for it."""
    out = {}

    def build():
        try:
            out["server"] = build_server(*args, **kw)
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e

    helper = threading.Thread(target=build, name="s2d-build", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.1)
    if "error" in out:
        raise out["error"]
    return out["server"]


def build_server(target: str, draft: str | None = None, *, method: str = "s2d",
                 name: str | None = None, gamma: int | None = None, thresholds=None,
                 exit: int | None = None, exits=None, dtype: str | None = None,
                 chat_template: str = "auto", slots: int = 8, max_len: int | None = None,
                 chunk_rounds: int = 4, max_queue: int = 64, default_max_tokens: int = 128,
                 host: str = "127.0.0.1", port: int = 8000, seed: int = 0,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, sock=None,
                 progress=None, fit_context: bool = False) -> Server:
    """Bind host:port (unless given `sock`, a listen.bind socket), load, build and warm
    what the first requests need (launch.warm_first; the worker compiles the rest while
    idle) -> a Server not yet started. `progress(line)` gets a line per stage;
    fit_context: a max_len past the models' context is cut to it (a default's), not
    refused (a user's)."""
    from s2d_jax import validate
    from s2d_jax.server.listen import bind

    validate.choice(chat_template, "chat_template", ("auto", "vicuna", "none"))
    validate.text(name, "name", optional=True)
    validate.integer(max_body_bytes, "max_body_bytes", 1, hi=1 << 62)
    if sock is None:  # before minutes of loading and compiling
        sock = bind(validate.text(host, "host"), validate.integer(port, "port", 0, 65535))
    try:
        engine, template, rest = _warmed_engine(
            target, draft, progress or (lambda line: None), method=method, gamma=gamma,
            thresholds=thresholds, exit=exit, exits=exits, dtype=dtype,
            chat_template=chat_template, slots=slots, max_len=max_len,
            chunk_rounds=chunk_rounds, seed=seed, fit_context=fit_context)
        model = name or os.path.basename(os.path.normpath(target))
        return Server(engine, model=model, template=template, host=host,
                      max_queue=max_queue, default_max_tokens=default_max_tokens,
                      max_body_bytes=max_body_bytes, sock=sock, background=rest,
                      say=progress)
    except BaseException:
        sock.close()
        raise


def _warmed_engine(target, draft, say, *, method, gamma, thresholds, exit, exits, dtype,
                   chat_template, slots, max_len, chunk_rounds, seed, fit_context=False):
    """Load, build and warm for the first requests -> (SlotEngine, the resolved chat
    template, the rest of the warm-up: warm_first)."""
    from s2d_jax.data.prompts import end_of_turn_id, resolve_template
    from s2d_jax.decode.chat import load_decoder
    from s2d_jax.server.slots import SlotEngine

    decoder, tok, notes = load_decoder(target, draft, method=method, gamma=gamma,
                                       thresholds=thresholds, exit=exit, exits=exits,
                                       dtype=dtype)
    template, note = resolve_template(tok, chat_template)
    for line in notes + ([note] if note else []):
        say(line)
    if fit_context and max_len is not None:
        max_len = min(max_len, decoder.context)
    engine = SlotEngine(decoder, tok, slots=slots, max_len=max_len, chunk_rounds=chunk_rounds,
                        eos_id=end_of_turn_id(tok, template), seed=seed)
    rest = warm_first(engine, say)
    return engine, template, rest


def warm_first(engine, say):
    """Warm what the first requests need (warm_up.stages until `ready`), a progress line
    per piece -> the generator of the rest (the worker runs it while idle)."""
    import collections

    from s2d_jax.server.warm_up import stages
    counts, t0 = collections.Counter(), time.perf_counter()
    steps = stages(engine, counts)
    for label, ready in steps:
        say(f"warming: {label} ({time.perf_counter() - t0:.0f} s)")
        if ready:
            break
    say(f"ready for the first requests after {time.perf_counter() - t0:.1f} s of warm-up "
        f"({sum(counts.values())} programs; prompt widths up to {engine.max_len} and up to "
        f"{engine.slots} rows compile in the background: {engine.slots} slots of "
        f"{engine.max_len} tokens)")
    if engine.policy is not None:
        say("round seconds per row bucket (speculative / AR -> the tokens per round "
            "speculation needs; buckets not yet measured: 1 row's): " + ", ".join(
                f"{r['rows']}: {r['spec_round_s'] * 1e3:.0f} / {r['ar_round_s'] * 1e3:.0f} ms "
                f"-> {r['break_even_tokens_per_round']:.2f}" for r in engine.policy.table()))
    return steps
