"""Images in chat requests: OpenAI's ``image_url`` content parts — ``data:`` URLs, or ``http(s)`` URLs fetched with a
size limit, a timeout and (``--allowed-media-domains``) only from the domains the server allows. What cannot be
read is a ValueError naming the part; decoding the image is the engine's (``hfaccel.engine.media``)."""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

MAX_IMAGE_BYTES = 20 << 20  # an encoded image larger than this is refused
FETCH_TIMEOUT = 10.0  # seconds to fetch one image URL


def image_bytes(url: str, allowed_domains: Sequence[str], what: str) -> bytes:
    """The encoded image an ``image_url`` points at (blocking: fetching waits on the network); a ValueError naming
    ``what`` when it cannot be had. ``allowed_domains``: the hosts (and their subdomains) URLs may be fetched from;
    empty: any."""
    if url.startswith("data:"):
        return _data_url(url, what)
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"{what}: an image URL is a data: URL or an http(s) URL; got {url[:40]!r}")
    host = (parsed.hostname or "").lower()
    if allowed_domains and not any(host == d or host.endswith("." + d) for d in allowed_domains):
        raise ValueError(
            f"{what}: {host!r} is not among the domains this server fetches images from (--allowed-media-domains)"
        )
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise ValueError(f"{what}: fetching {url[:80]!r} failed ({error})") from None
    return _within_limit(data, what)


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
