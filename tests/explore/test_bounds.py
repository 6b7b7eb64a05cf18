"""The explorer cannot be exhausted from inside its own limits: a body nested thousands
deep is a 400, a body shorter than its Content-Length a 408 (not a hung thread), a search runs in
a child process bounded in time and memory, and a search whose client leaves is cancelled."""

from __future__ import annotations

import json
import multiprocessing
import socket
import time

import pytest

from fivefold.explore import bounded
from fivefold.explore import server as server_module

BIG_SEARCH = {
    "model": {"preset": "llama3-405b"},
    "cluster": {"preset": "dgx-h100", "gpus": 32768},
    "global_batch_tokens": 2**30,
    "top": 20,  # 20 finalists: over 1 GiB whatever the fitted efficiency parameters favour
}


def _raw_post(srv, body: bytes, length: int | None = None) -> socket.socket:
    port = srv.server_address[1]
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST /api/search HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length or len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _status(sock: socket.socket) -> int:
    return int(sock.recv(65536).split(b" ", 2)[1])


def test_deeply_nested_body_is_a_bad_request(client):
    status, data = client.post("/api/search", b"[" * 5_000 + b"]" * 5_000)
    assert status == 400 and "nested too deeply" in data["problems"][0]


def test_body_shorter_than_its_length_is_answered(server, monkeypatch):
    monkeypatch.setattr(server_module.ExploreHandler, "timeout", 1.0)
    started = time.monotonic()
    sock = _raw_post(server, b'{"model": {}', length=1000)
    assert _status(sock) == 408
    assert time.monotonic() - started < 10
    sock.close()


def test_search_over_its_time_limit_is_stopped(client, monkeypatch):
    monkeypatch.setattr(bounded, "TIME_LIMIT_S", 1.0)
    monkeypatch.setattr(bounded.run_bounded, "__defaults__", (1.0, bounded.MEMORY_LIMIT_BYTES))
    started = time.monotonic()
    status, data = client.post("/api/search", BIG_SEARCH)
    assert status == 503 and "did not finish within 1 s" in data["problems"][0]
    assert time.monotonic() - started < 10
    assert not multiprocessing.active_children()  # the search's process is gone


def test_search_over_its_memory_limit_is_refused(client, monkeypatch):
    limit = 600 * 2**20  # enough to start the planner, not for this search (~1 GiB)
    monkeypatch.setattr(bounded.run_bounded, "__defaults__", (120.0, limit))
    status, data = client.post("/api/search", BIG_SEARCH)
    assert status == 507 and "more than 1 GiB of memory" in data["problems"][0], data


def test_search_is_cancelled_when_the_client_leaves(server):
    sock = _raw_post(server, json.dumps(BIG_SEARCH).encode())
    deadline = time.monotonic() + 10
    while not multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children(), "the search never started"
    sock.close()
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()  # killed well before its ~15 s of work


@pytest.mark.parametrize("body", [{"model": {"preset": "tiny"}, "global_batch": 8}])
def test_a_small_search_still_answers(client, body):
    status, data = client.post("/api/search", {**body, "cluster": {"preset": "dgx-h100"}})
    assert status == 200 and data["ok"] and data["best"] is not None
