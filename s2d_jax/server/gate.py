"""The HTTP side of a server that is still loading: uvicorn serves this ASGI app from the
first second, so /health answers at once with the state (loading, warming) and the
warm-up's last progress line (503 until ready, as a load balancer expects), and every
other path gets OpenAI's error shape with 503 and Retry-After. Once the engine is warm
for the first requests, `open(app)` hands every request to the real app (app.py).
"""

from __future__ import annotations

import json
import time

RETRY_AFTER_S = 5


class Gate:
    """An ASGI app: the real one once `open`ed, the warm-up's state until then."""

    def __init__(self, model: str):
        self.model, self.app = model, None
        self.state, self.stage = "loading", "reading the model"
        self.t0 = time.monotonic()

    def say(self, line: str) -> None:
        """A progress line of the warm-up: the stage /health shows."""
        self.state = "warming" if line.startswith("warming") else self.state
        self.stage = line

    def open(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            body = {"status": self.state, "model": self.model, "stage": self.stage,
                    "seconds": round(time.monotonic() - self.t0, 1)}
        else:
            body = {"error": {"message": f"the server is {self.state} ({self.stage}); retry "
                                         f"in a few seconds (GET /health says when it is "
                                         f"ready)", "type": "server_error",
                              "param": None, "code": "warming_up"}}
        await _send_json(send, 503, body, {"retry-after": str(RETRY_AFTER_S)})


async def _send_json(send, status: int, body: dict, headers: dict) -> None:
    data = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    head += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})
