"""What a connection may hold before its request (models/llama/serve/connections.py), over real sockets:
the cap on open connections (503 in the API's error shape past it, served again once idle ones have
timed out), the header timeout (idle and one-byte-a-while sockets closed), uvicorn's malformed-request
answer in the error shape, and a request head over h11's bound refused even in one read. The
connection layer needs no model: a one-route ASGI app stands in for the API, in a thread of this
process. Two tests run ``server.run`` in a process of their own, still without a model, for what is
the process's: its open-files limit (sockets past it log a few lines, not one per accept attempt; then
SIGTERM drains it and it exits 0) and its exit status after the engine thread died.
"""
import asyncio
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

uvicorn = pytest.importorskip("uvicorn")
from models.llama.serve.connections import ConnectionLimits, LimitedH11Protocol  # noqa: E402
from conftest import running_in_thread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("serve_connections")  # one worker, one server for the first three
MAX_CONNECTIONS, HEADER_TIMEOUT = 8, 1.0
REQUEST = b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

async def app(scope, receive, send):
    """A stand-in for the API: every request is answered 200 "ok"."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Engine:
    """What ``server.run`` reads of its ``EngineService``: a serving one, or one whose thread died."""
    error, in_flight, draining = None, 0, False

    def __init__(self, alive=True):
        self.alive = alive
        if not alive:
            self.error = RuntimeError("the engine thread's bug")

    def idle(self):
        return True

    def start_drain(self):
        self.draining = True


@pytest.fixture(scope="module")
def server():
    limits = ConnectionLimits(MAX_CONNECTIONS, HEADER_TIMEOUT)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            http=functools.partial(LimitedH11Protocol, limits=limits))
    with running_in_thread(uvicorn.Server(config)) as server:
        yield server


def address(server):
    return server.servers[0].sockets[0].getsockname()


def connections(server, count, timeout=5.0):
    """Waits until the server holds ``count`` connections."""
    deadline = time.monotonic() + timeout
    while len(server.server_state.connections) != count:
        assert time.monotonic() < deadline, (len(server.server_state.connections), count)
        time.sleep(0.01)


def exchange(server, data: bytes, timeout=5.0) -> tuple[int, dict, bytes]:
    """Sends ``data`` on a new connection; the answer's (status, headers, body), read to the connection's close
    or the body's end."""
    with socket.create_connection(address(server), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: (\d+)", head, re.I)
            if length and len(body) >= int(length.group(1)):
                break
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


async def late_request(server) -> bytes:
    """What a client reads that connects, waits, sends a request head and, a moment later, its body."""
    reader, writer = await asyncio.open_connection(*address(server))
    await asyncio.sleep(0.3)
    writer.write(b"POST /ok HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 5\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.write(b"hello")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (it never answers on it)."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def assert_error(status, headers, body, expected_status, code):
    assert status == expected_status and headers["content-type"] == "application/json", (status, headers, body)
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"] and set(error) == {"message", "type", "param", "code"}


def test_the_cap_of_idle_sockets_then_a_request_gets_a_prompt_503_then_200_once_they_timed_out(server):
    connections(server, 0)
    idle = [socket.create_connection(address(server)) for _ in range(MAX_CONNECTIONS)]
    try:
        connections(server, MAX_CONNECTIONS)
        t0 = time.monotonic()
        assert_error(*exchange(server, REQUEST), 503, "too_many_connections")  # answered at once, not queued
        assert time.monotonic() - t0 < HEADER_TIMEOUT / 2
        # a client that sends after the refusal (its head, then its body) still reads it: the refused socket
        # lingers; closed at once, the client's writes met a reset that discarded the answer unread
        for _ in range(2):
            assert asyncio.run(late_request(server)).startswith(b"HTTP/1.1 503 ")
        assert all(closed_within(sock, HEADER_TIMEOUT + 2) for sock in idle)  # the header timeout frees the cap
        assert exchange(server, REQUEST)[::2] == (200, b"ok")
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_without_a_whole_request_head_is_closed_after_the_header_timeout(server):
    connections(server, 0)
    with socket.create_connection(address(server)) as silent, socket.create_connection(address(server)) as slow:
        t0 = time.monotonic()
        for byte in REQUEST[:8]:  # one byte every 0.1 s: each arrival would restart a per-read timer
            slow.send(bytes([byte]))
            time.sleep(0.1)
        assert closed_within(silent, HEADER_TIMEOUT + 2) and closed_within(slow, HEADER_TIMEOUT + 2)
        assert time.monotonic() - t0 >= HEADER_TIMEOUT * 0.9
    # a kept-alive connection's next request has the same time for its head, from its first byte
    with socket.create_connection(address(server)) as kept:
        kept.sendall(REQUEST)
        answer = b""
        while not answer.endswith(b"ok"):
            answer += kept.recv(4096)
        kept.send(REQUEST[:5])
        assert closed_within(kept, HEADER_TIMEOUT + 2)  # before the keep-alive timeout (5 s) would have


def test_malformed_requests_and_a_head_over_h11s_bound_are_answered_400_in_the_error_shape(server):
    connections(server, 0)
    assert_error(*exchange(server, b"NOT HTTP AT ALL\r\n\r\n"), 400, "invalid_http_request")
    many_headers = b"".join(b"X-%d: v\r\n" % k for k in range(10_000))  # ~90 KB in one write: h11 alone took it
    assert_error(*exchange(server, REQUEST[:-2] + many_headers + b"\r\n"), 400, "invalid_http_request")
    assert exchange(server, REQUEST[:-2] + b"X-a: v\r\n" * 100 + b"\r\n")[0] == 200


# ---- a process of its own: the open-files limit, the exit status ----
def serve_in_process(tmp_path, engine: str, *, open_files_spare: int | None = None, **run_options):
    """Starts ``server.run`` on the stand-in app in a process of its own; (process, its log's path, url)."""
    script = tmp_path / "serve.py"
    limit = "" if open_files_spare is None else (
        f"spare = len(os.listdir('/proc/self/fd')) + {open_files_spare}\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (spare, spare))\n")
    script.write_text("import logging, os, resource, sys\nfrom models.llama.serve.server import run\n"
                      "from test_serve_connections import Engine, app\n"
                      "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')\n"
                      + limit + f"sys.exit(run(app, {engine}, host='127.0.0.1', port=0, **{run_options!r}))\n")
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]  # the checkout; this file
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    log = tmp_path / "server.log"
    process = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=log.open("w"),
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (found := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(log.read_text()[-3000:])
        time.sleep(0.1)
    return process, log, ("127.0.0.1", int(found.group(1)))


def test_sockets_past_the_open_files_limit_log_a_few_lines_not_one_per_accept(tmp_path):
    """1100 sockets that sent nothing against a 1024 open-files limit logged 199,817 lines in 13 s; here
    300 sockets against 40 spare descriptors (a cap above them on purpose) log under 50 lines, 10 kB."""
    process, log, addr = serve_in_process(tmp_path, "Engine()", open_files_spare=40, max_connections=1000,
                                          header_timeout_s=1.0)
    try:
        idle = [socket.create_connection(addr) for _ in range(300)]
        time.sleep(3)  # accept() fails (EMFILE) and asyncio retries once a second
        for sock in idle:
            sock.close()
        deadline, status = time.monotonic() + 15, None
        while status != 200:  # once the accepted ones timed out and the closed ones were accepted and gone
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with socket.create_connection(addr, timeout=2) as sock:
                    sock.sendall(REQUEST)
                    status = int(sock.recv(4096).split()[1])
            except (OSError, IndexError, ValueError):
                time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "SIGTERM: draining" in text and "drained: shutting down" in text, text[-3000:]  # not uvicorn's own stop
    assert "accept() failed: [Errno 24] Too many open files" in text, text[-3000:]
    assert len(text.splitlines()) < 50 and len(text) < 10_000, text[-3000:]


def test_a_dead_engine_thread_drains_and_exits_70(tmp_path):
    """vLLM's behaviour: a dead engine ends the server, non-zero, so that a supervisor restarts it."""
    process, log, addr = serve_in_process(tmp_path, "Engine(alive=False)")
    try:
        assert process.wait(30) == os.EX_SOFTWARE == 70, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert "the engine thread stopped (RuntimeError(\"the engine thread's bug\"))" in log.read_text()
