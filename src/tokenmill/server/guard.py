"""The outermost layer of the app (pure ASGI): what every HTTP request meets first, in the order that matters
against a hostile client.

1. The API key, from the headers alone, before a byte of the body is read (401 with `WWW-Authenticate`):
   `Authorization: Bearer <key>` (OpenAI's) or `x-api-key: <key>` (Anthropic's), on every path.
   /health and /metrics are open; /docs and /openapi.json follow the key unless `--public-docs`; the web page
   (`/` and its files under `/ui/`) is open, and asks for the key for the API calls it makes.
2. The body size: a declared `Content-Length` over the limit is refused at once, and a body that streams past
   it is cut off (413).
Errors come in the shape of the API the path belongs to (errors.body_for).
3. The app. An exception that escapes it becomes one JSON 500, and the connection stays usable: Starlette's
   own error middleware sends the 500 and re-raises, which would make uvicorn log twice and drop the
   keep-alive connection.

Must not import torch.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import body_for
from tokenmill.server.state import ServerState

log = logging.getLogger("tokenmill.server")

OPEN_PATHS = frozenset({"/health", "/metrics"})
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
WEB_UI_PREFIX = "/ui/"


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body too large: the limit is {limit} bytes (--max-body-mb)")


class RequestGuard:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.state.config
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if not self._authorized(path, headers.get("authorization", ""), headers.get("x-api-key")):
            message = "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')"
            await _send_json(send, 401, body_for(path, 401, message), {"www-authenticate": "Bearer"})
            return
        limit = cfg.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _send_json(send, 413, body_for(path, 413, BodyTooLarge(limit).detail), {"connection": "close"})
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
            return message

        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception as exc:  # what no error handler answered; it must not reach uvicorn
            request_id = headers.get("x-request-id", "-")
            log.exception("unexpected error on %s %s (request id %s)", scope.get("method"), scope["path"], request_id)
            if not started:
                body = body_for(path, 500, f"internal server error ({type(exc).__name__})")
                await _send_json(send, 500, body, {})

    def _authorized(self, path: str, bearer: str, api_key: str | None) -> bool:
        cfg = self.state.config
        if cfg.api_key is None or path in OPEN_PATHS or (cfg.public_docs and path in DOCS_PATHS):
            return True
        if cfg.web_ui and (path == "/" or path.startswith(WEB_UI_PREFIX)):
            return True  # the page's own files hold no data; every API call it makes needs the key
        key_ok = api_key is not None and hmac.compare_digest(api_key.encode(), cfg.api_key.encode())
        return key_ok or hmac.compare_digest(bearer.encode(), f"Bearer {cfg.api_key}".encode())


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
