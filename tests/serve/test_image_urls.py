"""http(s) image URLs, fetched from a real HTTP server on 127.0.0.1: the image's bytes; a redirect followed only to
a host the server may fetch from; a size limit and a deadline on the whole fetch; each refusal a ValueError naming
the part (the server's 400)."""

import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hfaccel.serve import media
from hfaccel.serve.media import image_bytes

IMAGE = bytes(range(256)) * 5  # the bytes served (decoding them is the engine's)
PART = "messages[0].content[1]"


class _Images(BaseHTTPRequestHandler):
    def do_GET(self):
        port = self.server.server_address[1]
        if self.path == "/image.png":
            self._send(IMAGE)
        elif self.path.startswith("/to-"):  # /to-HOST: a redirect to that host's /image.png
            self.send_response(302)
            self.send_header("Location", f"http://{self.path[len('/to-') :]}:{port}/image.png")
            self.end_headers()
        elif self.path == "/large":
            self._send(bytes(media.MAX_IMAGE_BYTES + 1))
        elif self.path.startswith("/slow-"):  # /slow-N: N bytes every 50 ms, each read in time, the fetch not
            self.send_response(200)
            self.end_headers()
            for _ in range(40):
                self.wfile.write(bytes(int(self.path[len("/slow-") :])))
                self.wfile.flush()
                time.sleep(0.05)
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_image_url_gives_its_bytes(host):
    assert image_bytes(f"http://{host}/image.png", (), PART) == IMAGE
    assert image_bytes(f"http://{host}/image.png", ("127.0.0.1",), PART) == IMAGE


def test_a_redirect_is_followed_only_to_an_allowed_host(host):
    """A redirect to another host than the allowed one is refused (it would fetch what the server may not);
    one to an allowed host, or with no domains given, is followed."""
    port = host.split(":")[1]
    assert image_bytes(f"http://{host}/to-127.0.0.1", ("127.0.0.1",), PART) == IMAGE
    assert image_bytes(f"http://localhost:{port}/to-127.0.0.1", (), PART) == IMAGE
    with pytest.raises(ValueError, match=re.escape(f"{PART} (redirected): '127.0.0.1' is not among the domains")):
        image_bytes(f"http://localhost:{port}/to-127.0.0.1", ("localhost",), PART)


@pytest.mark.parametrize(
    "path, limits, message",
    [
        ("/large", {}, "larger than"),
        ("/slow-65536", {"FETCH_TIMEOUT": 0.5}, "took more than 0.5 s"),
        ("/slow-1", {"FETCH_TIMEOUT": 0.5}, "took more than 0.5 s"),
        ("/missing", {}, "HTTP Error 404"),
    ],
)
def test_an_image_url_that_cannot_be_had_is_a_clear_error(host, monkeypatch, path, limits, message):
    for name, value in limits.items():
        monkeypatch.setattr(media, name, value)
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"{re.escape(PART)}: .*{message}"):
        image_bytes(f"http://{host}{path}", (), PART)
    assert time.monotonic() - started < 1.5  # (40 slow writes take 2 s)


def test_an_image_url_without_a_host_is_refused():
    with pytest.raises(ValueError, match="names no host"):
        image_bytes("http:///image.png", (), PART)
