"""A tiny HTTP client for the explorer tests (standard library only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class Client:
    """A tiny HTTP client for the API tests: (status, parsed JSON or text)."""

    def __init__(self, base: str):
        self.base = base.rstrip("/")

    def request(self, method: str, path: str, body: bytes | None = None, headers=None):
        req = urllib.request.Request(self.base + path, data=body, method=method)
        for key, value in (headers or {}).items():
            req.add_header(key, value)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers, err.read()

    def get_json(self, path: str):
        status, _, raw = self.request("GET", path)
        return status, json.loads(raw)

    def post(self, path: str, payload) -> tuple[int, dict]:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, _, out = self.request("POST", path, raw, {"Content-Type": "application/json"})
        return status, json.loads(out)
