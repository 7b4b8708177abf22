"""Images in chat requests: OpenAI's ``image_url`` content parts — ``data:`` URLs, or ``http(s)`` URLs fetched with a
size limit, a timeout and (``--allowed-media-domains``) only from the domains the server allows. What cannot be
read is a ValueError naming the part; decoding the image is the engine's (``hfaccel.engine.media``)."""

from __future__ import annotations

import base64
import binascii
import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

MAX_IMAGE_BYTES = 20 << 20  # an encoded image larger than this is refused
FETCH_TIMEOUT = 10.0  # seconds to fetch one image URL, redirects and all
_CHUNK = 1 << 16


def image_bytes(url: str, allowed_domains: Sequence[str], what: str) -> bytes:
    """The encoded image an ``image_url`` points at (blocking: fetching waits on the network); a ValueError naming
    ``what`` when it cannot be had. ``allowed_domains``: the hosts (and their subdomains) URLs may be fetched from —
    the URL's and every redirect's; empty: any."""
    if url.startswith("data:"):
        return _data_url(url, what)
    _check_url(url, allowed_domains, what)
    deadline = time.monotonic() + FETCH_TIMEOUT
    opener = urllib.request.build_opener(_CheckedRedirects(allowed_domains, what, deadline))
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT) as response:
            return _read_until(response, deadline, what)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        raise ValueError(f"{what}: fetching {url[:80]!r} failed ({error})") from None


def _check_url(url: str, allowed_domains: Sequence[str], what: str) -> None:
    """A ValueError unless ``url`` is http(s) on one of ``allowed_domains`` (any where empty)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"{what}: an image URL is a data: URL or an http(s) URL; got {url[:40]!r}")
    host = (parsed.hostname or "").lower()
    if not host:
        raise ValueError(f"{what}: the image URL {url[:40]!r} names no host")
    if allowed_domains and not any(host == d or host.endswith("." + d) for d in allowed_domains):
        raise ValueError(
            f"{what}: {host!r} is not among the domains this server fetches images from (--allowed-media-domains)"
        )


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL the server would fetch itself (``_check_url``), and only before the fetch's
    ``deadline``."""

    def __init__(self, allowed_domains: Sequence[str], what: str, deadline: float):
        self.allowed_domains, self.what, self.deadline = allowed_domains, what, deadline

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        try:
            _check_url(newurl, self.allowed_domains, f"{self.what} (redirected)")
            if time.monotonic() > self.deadline:
                raise ValueError(f"{self.what}: fetching the image took more than {FETCH_TIMEOUT:g} s")
        except ValueError:
            fp.close()  # the redirect's own response: its connection is not followed
            raise
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _read_until(response, deadline: float, what: str) -> bytes:
    """The response's body, refused once it passes ``MAX_IMAGE_BYTES`` or ``deadline``. Each read returns what has
    arrived (``read1``), so a server that sends slowly holds a worker thread past the deadline by one network wait at
    most (the socket's timeout)."""
    data = bytearray()
    while chunk := response.read1(_CHUNK):
        data += chunk
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"{what}: the image is larger than {MAX_IMAGE_BYTES} bytes")
        if time.monotonic() > deadline:
            raise ValueError(f"{what}: fetching the image took more than {FETCH_TIMEOUT:g} s")
    return bytes(data)


def _data_url(url: str, what: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ValueError(f"{what}: a data: URL of an image is 'data:<mime type>;base64,<data>'")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{what}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return _within_limit(base64.b64decode(payload, validate=True), what)
    except binascii.Error as error:
        raise ValueError(f"{what}: the data: URL's base64 does not decode ({error})") from None


def _within_limit(data: bytes, what: str) -> bytes:
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{what}: the image is larger than {MAX_IMAGE_BYTES} bytes")
    return data
