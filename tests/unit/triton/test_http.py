"""The one small HTTP client every Triton call goes through: statuses returned, no answer
worded in a few words, against a real HTTP server on loopback."""

import http.server
import threading

import pytest

from tritonguard.ops.server import free_port
from tritonguard.triton import http as triton_http


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        code = 200 if self.path == "/ok" else 400
        body = b"fine" if code == 200 else b'{"error":"unknown model"}'
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        length = int(self.headers["Content-Length"])
        body = self.rfile.read(length)
        answer = (self.headers["Content-Type"] + " " + self.headers.get("x-key", "") + " ").encode() + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def base():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_statuses_are_returned_and_bodies_kept(base):
    assert triton_http.request(f"{base}/ok") == (200, b"fine")
    assert triton_http.request(f"{base}/missing") == (400, b'{"error":"unknown model"}')
    status, body = triton_http.request(f"{base}/load", "POST", b"{}", headers={"x-key": "k"})
    assert status == 200 and body == b"application/json k {}"
    assert triton_http.get_text(f"{base}/ok") == "fine"
    with pytest.raises(triton_http.Unreachable, match="HTTP 400"):
        triton_http.get_text(f"{base}/missing")


def test_no_answer_is_worded_in_a_few_words():
    url = f"http://127.0.0.1:{free_port()}/v2/health/ready"  # nothing listens there
    with pytest.raises(triton_http.Unreachable) as exc:
        triton_http.request(url, timeout=2)
    assert exc.value.reason == "connection refused" and isinstance(exc.value, OSError)
    with pytest.raises(triton_http.Unreachable):
        triton_http.request("not a url")
