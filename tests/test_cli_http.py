"""The client commands' HTTP client (standard library): requests, answers, and a request
that gets no answer turned into the one-line errors of :class:`ApiClient`."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from org_node.cli_common import ApiClient, ClientError
from org_node.cli_http import ConnectFailed, HttpClient, TimedOut


class _Echo(BaseHTTPRequestHandler):
    """Answers with what it got, as JSON; ``/slow`` after a while, ``/text`` as text."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if "/slow" in self.path:
            time.sleep(1.0)
        if "/text" in self.path:
            self._send(200, b"plain words", "text/plain")
            return
        status = 409 if "/conflict" in self.path else 200
        if "/unauthorized" in self.path:
            status = 401
        answer = {
            "method": self.command,
            "path": self.path,
            "authorization": self.headers.get("Authorization"),
            "content_type": self.headers.get("Content-Type"),
            "body": body.decode(),
            "detail": "run r1 is aborted" if status == 409 else None,
        }
        self._send(status, json.dumps(answer).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = do_PATCH = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up on ``/slow`` closed the socket: nothing to report."""


@pytest.fixture
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_requests_and_answers(server: str) -> None:
    http = HttpClient(server + "/api/", {"Authorization": "Bearer t"})
    r = http.request("POST", "/v1/runs", json={"name": "é", "n": 1})
    assert r.status_code == 200 and r.reason_phrase == "OK"
    assert r.headers["content-type"] == "application/json"
    got = r.json()
    assert got["method"] == "POST" and got["path"] == "/api/v1/runs"
    assert got["authorization"] == "Bearer t" and got["content_type"] == "application/json"
    assert json.loads(got["body"]) == {"name": "é", "n": 1}
    r = http.request("GET", "/v1/runs", params={"state": "running", "limit": 5, "x": None})
    assert r.json()["path"] == "/api/v1/runs?state=running&limit=5"
    assert http.request("DELETE", "/v1/tokens/3").json()["method"] == "DELETE"
    assert http.request("GET", "/text").text == "plain words"


def test_api_client_over_it(server: str) -> None:
    api = ApiClient(server, "t")
    assert api.get("/v1/x", limit=3)["path"] == "/v1/x?limit=3"
    assert api.request("GET", "/text") == "plain words"
    with pytest.raises(ClientError) as conflict:
        api.post("/conflict/v1/runs/r1/start")
    assert str(conflict.value) == "run r1 is aborted"
    with pytest.raises(ClientError) as unauthorized:
        api.get("/unauthorized")
    assert str(unauthorized.value) == "authentication failed: check --token"
    api.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_answer_is_named(server: str) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ConnectFailed):
        HttpClient(url).request("GET", "/healthz")
    with pytest.raises(ClientError) as refused:
        ApiClient(url, "t").get("/v1/runs")
    assert str(refused.value) == f"no node answers at {url}"
    with pytest.raises(TimedOut):
        HttpClient(server, timeout=0.2).request("GET", "/slow")
    slow = ApiClient(server, "t")
    slow._http = HttpClient(server, timeout=0.2)
    with pytest.raises(ClientError) as late:
        slow.get("/slow")
    assert str(late.value) == f"the node at {server} did not answer in time"
    with pytest.raises(ValueError, match="not an http"):
        HttpClient("ftp://x")
