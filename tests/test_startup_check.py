"""ui/startup_check.py: the studio's start does not fail because a loaded machine answered one HEAD slowly."""
from __future__ import annotations

import http.server
import socket
import threading

import pytest

from ui import startup_check


class _Handler(http.server.BaseHTTPRequestHandler):
    calls = 0
    second_seen = threading.Event()
    lock = threading.Lock()

    def do_HEAD(self):                                     # noqa: N802 - http.server's name
        with _Handler.lock:
            _Handler.calls += 1
            n = _Handler.calls
        if n == 1:
            # the first answer is "slow": it waits until the client has given up on it and asked again
            _Handler.second_seen.wait(timeout=60)
        else:
            _Handler.second_seen.set()
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):                          # quiet
        pass


@pytest.fixture
def slow_first_server():
    _Handler.calls = 0
    _Handler.second_seen = threading.Event()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)     # bound before use
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/"
    _Handler.second_seen.set()
    srv.shutdown()
    srv.server_close()


def test_a_slow_first_answer_is_not_yet_rather_than_never(slow_first_server):
    assert startup_check.patient_url_ok(slow_first_server, deadline_s=60, request_timeout_s=0.5)
    assert _Handler.calls >= 2


def test_nothing_listening_gives_up_at_the_deadline():
    with socket.socket() as s:                             # a port that is bound and never listens
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/"
        assert startup_check.patient_url_ok(url, deadline_s=0.5, poll_s=0.05) is False


def test_install_replaces_gradios_check_once():
    from gradio import networking

    old = networking.url_ok
    try:
        startup_check.install()
        startup_check.install()
        assert networking.url_ok is startup_check.patient_url_ok
    finally:
        networking.url_ok = old
