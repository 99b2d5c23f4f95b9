"""Who may reach the studio: one authentication check in front of every route, and what a
visitor may do in public mode.

With `--auth`, `AccessGuard` (an ASGI middleware installed under Gradio's own) answers every
request the same way, whichever part of the app would serve it: Gradio's routes, the A1111 API
under /sdapi/v1, /metrics, file routes, /openapi.json. A request passes with Gradio's sign-in
cookie or with HTTP Basic credentials (what scripts and A1111 clients send); without either,
only the login page and its static assets answer, and the login page no longer embeds the API
description. Wrong passwords, by form or by Basic header, are rate limited per client address.
"""
from __future__ import annotations

import base64
import json
import re
import secrets
import threading
import time
from collections import deque
from typing import Callable

from core.settings import Settings

# what the login page itself needs before anyone signs in (everything else answers 401)
OPEN_PATHS = frozenset({"/", "/login", "/login/", "/favicon.ico", "/theme.css", "/gradio_api/theme.css",
                        "/manifest.json", "/robots.txt", "/gradio_api/login_check", "/gradio_api/login_check/",
                        "/gradio_api/app_id", "/gradio_api/app_id/",
                        "/healthz", "/readyz",   # probes: a status word and a short reason, nothing else
                        "/gradio_api/startup-events"})   # launch() calls it, unsigned, to start the queue
OPEN_PREFIXES = ("/assets/", "/static/", "/svelte/", "/pwa_icon", "/gradio_api/static/", "/gradio_api/assets/")
API_INFO = re.compile(rb"window\.gradio_api_info\s*=\s*.*?;\s*</script>", re.S)


class LoginLimiter:
    """At most `max_failures` wrong passwords per client in `window_s` seconds; after that the client
    is refused (even with the right password) until its oldest failure leaves the window."""

    def __init__(self, max_failures: int = 5, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.max_failures = max_failures
        self.window_s = window_s
        self.clock = clock
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, key: str) -> deque[float]:
        q = self._failures.setdefault(key, deque())
        now = self.clock()
        while q and now - q[0] >= self.window_s:
            q.popleft()
        return q

    def retry_after(self, key: str) -> float | None:
        """Seconds until `key` may try again, or None when it may try now."""
        with self._lock:
            q = self._recent(key)
            if len(q) < self.max_failures:
                return None
            return max(1.0, self.window_s - (self.clock() - q[0]))

    def failed(self, key: str) -> None:
        with self._lock:
            self._recent(key).append(self.clock())

    def succeeded(self, key: str) -> None:
        with self._lock:
            self._failures.pop(key, None)


def _basic_credentials(headers: dict[bytes, bytes]) -> tuple[str, str] | None:
    value = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        user, sep, pw = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (ValueError, UnicodeDecodeError):
        return ("", "\0")   # malformed: counts as a wrong password
    return (user, pw) if sep else ("", "\0")


def _cookies(headers: dict[bytes, bytes]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in headers.get(b"cookie", b"").decode("latin-1").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            out[name] = value
    return out


def strip_api_info(html: bytes) -> bytes:
    """The login page without the API description Gradio embeds in every page."""
    return API_INFO.sub(b'window.gradio_api_info = {"named_endpoints": {}, "unnamed_endpoints": {}};</script>',
                         html, count=1)   # empty, not null: the page script reads it


class AccessGuard:
    """ASGI middleware: every route behind the same sign-in. `auth` None = open (no check at all)."""

    def __init__(self, app, auth: tuple[str, str] | None = None, limiter: LoginLimiter | None = None):
        self.app = app
        self.auth = auth
        self.limiter = limiter or LoginLimiter()
        self._basic_token: str | None = None

    # -- checks ---------------------------------------------------------------------------------
    def _valid(self, user: str, pw: str) -> bool:
        ok_user = secrets.compare_digest(user.encode(), self.auth[0].encode())
        ok_pw = secrets.compare_digest(pw.encode(), self.auth[1].encode())
        return ok_user and ok_pw

    @staticmethod
    def _signed_in(scope, headers) -> bool:
        app = scope.get("app")
        tokens = getattr(app, "tokens", None)
        cookie_id = getattr(app, "cookie_id", None)
        if not tokens or not cookie_id:
            return False
        jar = _cookies(headers)
        token = jar.get(f"access-token-{cookie_id}") or jar.get(f"access-token-unsecure-{cookie_id}")
        return bool(token) and token in tokens

    def _as_signed_in(self, scope, user: str):
        """Basic credentials were right: hand Gradio's routes the sign-in cookie they check themselves
        (one token for all Basic requests, kept in Gradio's own token table)."""
        app = scope.get("app")
        tokens, cookie_id = getattr(app, "tokens", None), getattr(app, "cookie_id", None)
        if tokens is None or not cookie_id:
            return scope
        if self._basic_token is None or tokens.get(self._basic_token) != user:
            self._basic_token = secrets.token_urlsafe(16)
            tokens[self._basic_token] = user
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"cookie"]
        headers.append((b"cookie", f"access-token-{cookie_id}={self._basic_token}".encode()))
        return {**scope, "headers": headers}

    # -- answers ----------------------------------------------------------------------------------
    @staticmethod
    async def _reply(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
        body = json.dumps({"detail": message}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": body})

    async def _refuse(self, scope, send, path: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        # scripts (A1111 clients, curl) get the Basic challenge; the browser app gets a plain 401, no pop-up
        challenge = [(b"www-authenticate", b'Basic realm="atelier"')] if not path.startswith("/gradio_api/") else []
        await self._reply(send, 401, "this studio runs with --auth: sign in on its page, or send the user and "
                                     "password as HTTP Basic credentials", challenge)

    async def _too_many(self, scope, send, wait: float) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await self._reply(send, 429, f"too many wrong passwords from this address; try again in {wait:.0f} s",
                          [(b"retry-after", str(int(wait + 0.999)).encode())])

    # -- the middleware -------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if self.auth is None or scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "/")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        headers = dict(scope.get("headers") or [])
        client = (scope.get("client") or ("?", 0))[0]

        basic = _basic_credentials(headers)
        if basic is not None:
            wait = self.limiter.retry_after(client)
            if wait is not None:
                return await self._too_many(scope, send, wait)
            if self._valid(*basic):
                self.limiter.succeeded(client)
                return await self.app(self._as_signed_in(scope, basic[0]), receive, send)
            self.limiter.failed(client)
            return await self._refuse(scope, send, path)
        if self._signed_in(scope, headers):
            return await self.app(scope, receive, send)
        method = scope.get("method", "GET")
        if path in ("/login", "/login/") and method == "POST":
            wait = self.limiter.retry_after(client)
            if wait is not None:
                return await self._too_many(scope, send, wait)
            return await self.app(scope, receive, self._watch_login(send, client))
        if path == "/" and method in ("GET", "HEAD"):
            return await self.app(scope, receive, self._without_api_info(send))
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        return await self._refuse(scope, send, path)

    def _watch_login(self, send, client: str):
        """Count the login form's answer: 200 = signed in, anything else = a wrong password."""
        async def watched(message):
            if message["type"] == "http.response.start":
                if message["status"] == 200:
                    self.limiter.succeeded(client)
                else:
                    self.limiter.failed(client)
            await send(message)
        return watched

    @staticmethod
    def _without_api_info(send):
        """Buffer the login page and drop its embedded API description."""
        start: dict = {}
        chunks: list[bytes] = []

        async def filtered(message):
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            hdrs = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            ctype = dict(hdrs).get(b"content-type", b"")
            if b"text/html" in ctype:
                body = strip_api_info(body)
            hdrs.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": hdrs})
            await send({"type": "http.response.body", "body": body})
        return filtered


# -- what a visitor can do (public mode) ------------------------------------------------------------
def visitor_abilities(settings: Settings) -> list[str]:
    """One line per thing anyone who reaches the page can do, for the --share warning and the docs."""
    out = [f"generate images on this machine's {'GPU' if settings.device != 'cpu' else 'CPU'} "
           f"(one job at a time, up to {settings.queue_max_size} waiting), also through the A1111 API at /sdapi/v1 "
           "and gradio_client",
           "pick any model the catalogue lists (bundled, your model folders, models named with --model)"]
    if settings.visitor_may("hub"):
        out.append("download the catalogue's Hugging Face models (several GB each) into this machine's cache")
    if settings.visitor_may("add-model"):
        out.append("add models by file path on this machine or by Hugging Face id" if not settings.public else
                   "add models by file path on this machine or by Hugging Face id (kept in their own session)")
    if settings.visitor_may("train"):
        where = ("any folder on this machine" if not settings.public else
                 ", ".join(str(d) for d in settings.data_dirs) or "no folder (set ATELIER_DATA_DIRS)")
        out.append(f"start a training run on data from {where} (it takes the GPU for hours)")
    out.append("upload images (image-to-image, PNG info) up to 25 MB each; they stay in their own session")
    return out


def share_warning(settings: Settings) -> str | None:
    """The warning `--share` (or a public host) without `--auth` prints, naming what a visitor can do."""
    if settings.auth or not (settings.share or settings.on_space or settings.public):
        return None
    where = "anyone with the share link" if settings.share else "anyone who can reach this address"
    lines = [f"WARNING: no --auth: {where} can, without signing in:"]
    lines += [f"  - {a}" for a in visitor_abilities(settings)]
    lines.append(f"Mode: {settings.mode}. Add --auth user:password (or ATELIER_AUTH) to require a sign-in"
                 + ("; --mode public limits visitors to the catalogue." if not settings.public else "."))
    return "\n".join(lines)


# -- errors a visitor sees (public mode) --------------------------------------------------------------
_ABS_PATH = re.compile(r"(?<![\w:/.~-])(?:~|/)(?:[\w.@+~-]+/)+[\w.@+~-]*|(?<![\w:/.~-])/[\w.@+~-]+\.\w{1,12}\b")


def redact_paths(text: str) -> str:
    """'no model at /srv/models/ffhq.pkl' -> 'no model at ffhq.pkl': a server path says where the host keeps
    things (and, in an error, whether a file exists); its last part is all a visitor needs."""
    def short(m: re.Match) -> str:
        part = m.group(0).rstrip("/").rsplit("/", 1)[-1]
        return part or "…"
    return _ABS_PATH.sub(short, str(text))
