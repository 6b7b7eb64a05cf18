"""Running an expensive API view (the layout search) in a child process, bounded in memory and
time, and cancelled as soon as the client goes away.

A search for a 400B model on tens of thousands of GPUs costs seconds of CPU and about a GiB of
memory; several at once, or ones whose client has left, could exhaust the machine. Each such
request therefore runs in its own spawned process (the planner imports no torch, so it starts in
well under a second) with an address-space limit (`RLIMIT_AS`). The serving thread waits on a
pipe and, every `POLL_S`, checks the deadline and whether the client closed its connection; the
child is killed in every case but a finished answer. Written by hand: the standard library's
process pools cannot cancel one running task.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import select
import socket
import time
from http import HTTPStatus
from typing import Any

from fivefold.errors import ConfigError
from fivefold.explore import api
from fivefold.explore.api import ApiError

MEMORY_LIMIT_BYTES = 4 * 2**30
TIME_LIMIT_S = 120.0
POLL_S = 0.1


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def _child(view_name: str, body: Any, conn: Any, memory_limit_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))

    try:
        conn.send(("ok", getattr(api, view_name)(body)))
    except ApiError as err:
        conn.send(("problems", (err.problems, int(err.status))))
    except ConfigError as err:
        conn.send(("problems", (err.problems, int(HTTPStatus.BAD_REQUEST))))
    except MemoryError:
        conn.send(("memory", None))
    except Exception as err:  # a bug: the server reports it as such
        conn.send(("error", f"{type(err).__name__}: {err}"))


def client_gone(sock: socket.socket) -> bool:
    """Whether the peer has closed `sock` (readable with nothing to read); never blocks."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def run_bounded(
    view_name: str,
    body: Any,
    client: socket.socket,
    time_limit_s: float = TIME_LIMIT_S,
    memory_limit_bytes: int = MEMORY_LIMIT_BYTES,
) -> dict[str, Any]:
    """`fivefold.explore.api.<view_name>(body)` in a child process; its answer, or ApiError
    (bad request, over the memory or time limit), or ClientGone."""
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_child, args=(view_name, body, sender, memory_limit_bytes), daemon=True
    )
    proc.start()
    sender.close()
    deadline = time.monotonic() + time_limit_s
    try:
        while not receiver.poll(POLL_S):
            if client_gone(client):
                raise ClientGone
            if not proc.is_alive() and not receiver.poll(0):
                raise ApiError(_memory_message(memory_limit_bytes), HTTPStatus.INSUFFICIENT_STORAGE)
            if time.monotonic() > deadline:
                raise ApiError(
                    f"the request did not finish within {time_limit_s:.0f} s; narrow it (fewer "
                    "GPUs, a smaller batch, or pinned degrees) or use `fivefold plan`, which has "
                    "no such limit.",
                    HTTPStatus.SERVICE_UNAVAILABLE,
                )
        try:
            kind, payload = receiver.recv()
        except EOFError:  # the child ended without an answer: out of its memory, as above
            kind, payload = "memory", None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        receiver.close()
    if kind == "ok":
        return payload
    if kind == "problems":
        raise ApiError(*payload)
    if kind == "memory":
        raise ApiError(_memory_message(memory_limit_bytes), HTTPStatus.INSUFFICIENT_STORAGE)
    raise RuntimeError(payload)


def _memory_message(limit_bytes: int) -> str:
    return (
        f"the request needed more than {limit_bytes / 2**30:.0f} GiB of memory, the explorer's "
        "limit per request; narrow it or use `fivefold plan`, which has no such limit."
    )
