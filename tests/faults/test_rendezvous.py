"""Item: every rendezvous wait ends within --rdzv-timeout with one clear line, through the real launcher: a
listener that never answers, an endpoint served by something that is not a store, and the static backend with a
master that does not answer."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RDZV_TIMEOUT = 2
STARTUP_SLACK_S = 60
"""Starting the launcher (importing torch) on 2 busy cores; the launcher's own 'waited Ns' is held to the timeout."""


def _launch(*args: str) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "1", "--rdzv-timeout",
                           str(RDZV_TIMEOUT), *args, "-m", "json.tool", "--help"],
                          capture_output=True, text=True, timeout=RDZV_TIMEOUT + STARTUP_SLACK_S)
    return proc.returncode, proc.stderr, time.monotonic() - start


def _listener(answer: bytes | None):
    """A TCP listener on loopback that accepts and then says nothing (None) or replies ``answer``."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                try:
                    conn.recv(64)
                    conn.sendall(answer)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return server


def _last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


@pytest.mark.parametrize("answer, expected", [(None, "nothing answered the store handshake"),
                                              (b"HTTP/1.0 400 Bad Request\r\n\r\n" * 8, "not a torch store")],
                         ids=["silent_listener", "not_a_store"])
def test_endpoint_that_accepts_but_is_no_store(answer, expected):
    server = _listener(answer)
    try:
        port = server.getsockname()[1]
        code, err, wall = _launch("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}")
    finally:
        server.close()
    line = _last_line(err)
    assert code == 1, err
    assert line.startswith("meshrun launch: ") and expected in line and f"127.0.0.1:{port}" in line, err
    waited = int(re.search(r"waited (\d+)s", line).group(1))
    assert waited <= RDZV_TIMEOUT + 1, line
    assert wall < RDZV_TIMEOUT + STARTUP_SLACK_S


def test_static_backend_master_that_does_not_answer():
    server = _listener(None)  # accepts TCP (so the store client gets past connect) and never answers
    try:
        port = server.getsockname()[1]
        code, err, _ = _launch("--nnodes", "2", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "--node-rank", "1")
    finally:
        server.close()
    line = _last_line(err)
    assert code == 1, err
    assert "Traceback" not in err, err
    assert line.startswith("meshrun launch: ") and f"127.0.0.1:{port}" in line, err
    assert int(re.search(r"waited (\d+)s", line).group(1)) <= RDZV_TIMEOUT + 1, line
