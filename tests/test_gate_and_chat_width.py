"""The loading server's /health (server/gate.py: 503 with the state until the engine is
warm, then the real app) and chat's shared prompt width (a conversation's second turn
runs the first turn's programs: it compiles nothing), on the demo family."""

import asyncio

import httpx
import jax.monitoring

from s2d_jax.server.gate import RETRY_AFTER_S, Gate


def _get(app, path: str) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            return await client.get(path)
    return asyncio.run(go())


async def _ready_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"status": "ok"}'})


def test_health_is_503_with_the_state_while_loading_then_the_real_app():
    gate = Gate("smol")
    r = _get(gate, "/health")
    assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
    assert r.json()["status"] == "loading" and r.json()["model"] == "smol"
    gate.say("warming up: compiling prefill (1 of 4)")
    health = _get(gate, "/health").json()
    assert health["status"] == "warming" and health["stage"].startswith("warming up")
    r = _get(gate, "/v1/models")  # any other path: OpenAI's error shape, retry later
    assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up"
    gate.open(_ready_app)
    r = _get(gate, "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_a_chats_second_turn_compiles_nothing():
    from s2d_jax.decode.chat import Chat

    events = []

    def listen(name, secs, **kw):
        if "compile" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        chat = Chat("models/demo/target-s", "models/demo/draft", max_new_tokens=8)
        chat.say("ROMEO:")
        assert events, "the listener saw no compile: it no longer counts them"
        events.clear()
        # a longer message: without the shared width, a new prompt shape (new programs)
        chat.say("And what say you of the night, good friar, and the moon above it?")
        assert events == []
    finally:
        unregister = getattr(jax.monitoring, "_unregister_event_duration_listener_by_callback",
                             None)
        if unregister is not None:
            unregister(listen)
