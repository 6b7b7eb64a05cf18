"""The local web server behind `fivefold explore`: one page, its static files, a JSON API.

Built on the standard library's `ThreadingHTTPServer` (no web framework is needed for one page and
four endpoints). It binds to 127.0.0.1 only and answers only requests whose Host header names this
machine, so other machines and other web sites cannot reach it.

Routes:
    GET  /                  the page (static/index.html)
    GET  /static/<file>     its JavaScript (ES modules) and CSS (a fixed list read at start-up)
    GET  /api/presets       every choice the controls offer
    POST /api/estimate      one layout -> the planner's estimate + rank grid
    POST /api/search        model + cluster + batch target -> best layouts and the explanation
    POST /api/recipe        one layout -> TOML recipe text for `fivefold train`

A bad request is answered 400 with {"ok": false, "problems": [sentences]}; an unexpected failure
inside a handler is answered 500 with its message, and the server keeps serving. A search runs in
a child process bounded in memory and time and killed when its client leaves
(`fivefold.explore.bounded`); a body shorter than its Content-Length is answered 408 after
`READ_TIMEOUT_S`.
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fivefold.errors import ConfigError
from fivefold.explore.api import ApiError, estimate_view, presets_view, recipe_view, search_view
from fivefold.explore.bounded import ClientGone, run_bounded

HOST = "127.0.0.1"
STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 64 * 1024
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# Everything the page loads comes from this server: no CDN, no inline script.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
POST_ROUTES: dict[str, Callable[[Any], dict[str, Any]]] = {
    "/api/estimate": estimate_view,
    "/api/search": search_view,
    "/api/recipe": recipe_view,
}
# Views that may run for seconds and use a GiB: each runs in a bounded, cancellable child.
BOUNDED_VIEWS = {"/api/search": "search_view"}
READ_TIMEOUT_S = 15.0  # a client that announces more body than it sends is answered 408


def _static_files() -> dict[str, tuple[bytes, str]]:
    """The files under static/ by URL path, read once; nothing outside that folder is served."""
    files = {}
    for path in sorted(STATIC_DIR.rglob("*")):
        if path.is_file() and path.suffix in CONTENT_TYPES:
            url = "/static/" + path.relative_to(STATIC_DIR).as_posix()
            files[url] = (path.read_bytes(), CONTENT_TYPES[path.suffix])
    files["/"] = files["/static/index.html"]
    return files


class ExploreHandler(BaseHTTPRequestHandler):
    server: ExploreServer
    server_version = "fivefold-explore"
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S  # socket timeout: a stalled client cannot hold a thread forever

    # ---- plumbing ------------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, allow_nan=False).encode()
        self._send(status, body, "application/json")

    def _problem(self, status: int, problems: list[str]) -> None:
        self._send_json(status, {"ok": False, "problems": problems})

    def _host_allowed(self) -> bool:
        """Only this machine's names: guards against DNS rebinding from a web page."""
        host = (self.headers.get("Host") or "").strip().lower()
        port = self.server.server_address[1]
        return host in {f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1", "localhost"}

    # ---- verbs -----------------------------------------------------------------------------------
    def do_GET(self) -> None:
        if not self._host_allowed():
            self._problem(HTTPStatus.FORBIDDEN, ["this server answers only 127.0.0.1/localhost."])
            return
        path = self.path.split("?", 1)[0]
        if path == "/api/presets":
            self._send_json(HTTPStatus.OK, presets_view())
        elif path in self.server.static:
            body, content_type = self.server.static[path]
            self._send(HTTPStatus.OK, body, content_type)
        else:
            self._problem(HTTPStatus.NOT_FOUND, [f"no page at {path!r}; open / instead."])

    do_HEAD = do_GET

    def do_POST(self) -> None:
        if not self._host_allowed():
            self._problem(HTTPStatus.FORBIDDEN, ["this server answers only 127.0.0.1/localhost."])
            return
        path = self.path.split("?", 1)[0]
        view = POST_ROUTES.get(path)
        if view is None:
            self._discard_body()
            self._problem(HTTPStatus.NOT_FOUND, [f"no API endpoint {path!r}."])
            return
        try:
            body = self._read_json()
            if path in BOUNDED_VIEWS:
                answer = run_bounded(BOUNDED_VIEWS[path], body, self.connection)
            else:
                answer = view(body)
            self._send_json(HTTPStatus.OK, answer)
        except ClientGone:
            self.close_connection = True  # nobody to answer; the work was cancelled
        except ApiError as err:
            self._problem(err.status, err.problems)
        except ConfigError as err:
            self._problem(HTTPStatus.BAD_REQUEST, err.problems)
        except Exception as err:  # a bug, not the user's mistake: report it and keep serving
            traceback.print_exc()
            self._problem(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                [f"internal error ({type(err).__name__}: {err}); please report it."],
            )

    def _content_length(self) -> int:
        raw = self.headers.get("Content-Length")
        try:
            length = int(raw) if raw is not None else -1
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise ApiError("the request needs a Content-Length header.", HTTPStatus.LENGTH_REQUIRED)
        return length

    def _discard_body(self) -> None:
        try:
            length = self._content_length()
        except ApiError:
            return
        if length > MAX_BODY_BYTES:
            self.close_connection = True
        else:
            self.rfile.read(length)

    def _read_json(self) -> Any:
        length = self._content_length()
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body cannot be skipped safely
            raise ApiError(
                f"the request body has {length:,} bytes; the limit is {MAX_BODY_BYTES:,}.",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            raise ApiError(
                f"the request body ended before its Content-Length ({length:,} bytes) within "
                f"{self.timeout:.0f} s.",
                HTTPStatus.REQUEST_TIMEOUT,
            ) from None
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        except RecursionError:
            raise ApiError("the request body is nested too deeply to be a request.") from None
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as err:
            raise ApiError(f"the request body is not valid JSON: {err}.") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


class ExploreServer(ThreadingHTTPServer):
    """ThreadingHTTPServer on 127.0.0.1 with the page's files loaded once."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int = 0, verbose: bool = False):
        self.verbose = verbose
        self.static = _static_files()
        try:
            super().__init__((HOST, port), ExploreHandler)
        except (OSError, OverflowError) as err:
            reason = getattr(err, "strerror", None) or err
            raise ConfigError(
                f"--port {port}: cannot listen on {HOST}:{port} ({reason}); "
                "pick another port, or --port 0 for any free one."
            ) from None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}/"


def start_in_thread(port: int = 0) -> tuple[ExploreServer, threading.Thread]:
    """Start a server in a daemon thread (for tests and notebooks); stop it with `.shutdown()`."""
    server = ExploreServer(port)
    thread = threading.Thread(target=server.serve_forever, name="fivefold-explore", daemon=True)
    thread.start()
    return server, thread
