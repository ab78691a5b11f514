"""Where an image part's bytes come from: `data:` URLs (base64), http(s) URLs fetched with a size limit and a
timeout (refused when fetching is off), or bytes given directly (the Python API; the CLI reads a file into them)."""
from __future__ import annotations

import base64
import binascii
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ..errors import WasteError


@dataclass(frozen=True)
class FetchPolicy:
    allow_urls: bool = True        # http(s) image URLs fetched; False: refused (waste serve --no-image-urls)
    max_bytes: int = 20 * 2**20    # an image's encoded size, from a URL or a data: URL
    timeout: float = 10.0          # seconds for the whole fetch


def image_bytes(part: dict, policy: FetchPolicy, where: str) -> bytes:
    """The encoded image of one content part: {"type": "image_url", "image_url": {"url": ...}} (or the url as a
    string), {"type": "image", "image": bytes | url}, {"type": "input_image", "image_url": url}."""
    src = part.get("image_url") if part.get("type") in ("image_url", "input_image") else part.get("image")
    if isinstance(src, dict):
        src = src.get("url")
    if isinstance(src, (bytes, bytearray)):
        data = bytes(src)
    elif isinstance(src, str) and src.startswith("data:"):
        data = _data_url(src, where)
    elif isinstance(src, str) and src.split(":", 1)[0].lower() in ("http", "https"):
        data = _fetch(src, policy, where)
    else:
        shown = (src[:40] + "...") if isinstance(src, str) and len(src) > 40 else src
        raise WasteError(f"{where}: an image is a data: URL (base64) or an http(s) URL, not {shown!r}")
    if len(data) > policy.max_bytes:
        raise WasteError(f"{where}: the image is {len(data)} bytes; the limit is {policy.max_bytes}")
    return data


def _data_url(url: str, where: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise WasteError(f"{where}: a data: URL must be data:image/...;base64,<data>")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise WasteError(f"{where}: the data: URL's base64 does not decode") from None


def _fetch(url: str, policy: FetchPolicy, where: str) -> bytes:
    if not policy.allow_urls:
        raise WasteError(f"{where}: this server does not fetch image URLs (started with --no-image-urls); send the "
                         "image as a data: URL")
    req = urllib.request.Request(url, headers={"User-Agent": "waste"})
    try:
        deadline = time.monotonic() + policy.timeout
        with urllib.request.urlopen(req, timeout=policy.timeout) as r:
            chunks, n = [], 0
            while n <= policy.max_bytes:
                chunk = r.read(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                n += len(chunk)
                if time.monotonic() > deadline:
                    raise WasteError(f"{where}: fetching the image took longer than {policy.timeout:g} s")
            data = b"".join(chunks)
    except WasteError:
        raise
    except urllib.error.HTTPError as e:
        raise WasteError(f"{where}: fetching the image answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise WasteError(f"{where}: the image URL could not be fetched ({reason})") from None
    if len(data) > policy.max_bytes:
        raise WasteError(f"{where}: the image at the URL is larger than {policy.max_bytes} bytes")
    return data


def file_part(path: str) -> dict:
    """An image part from a file (`waste run --image`, `/image` in `waste chat`), checked to decode now."""
    from pathlib import Path

    from .decode import open_image

    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise WasteError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WasteError(f"{path} is a directory, not an image file") from None
    except OSError as e:
        raise WasteError(f"{path} cannot be read ({e.strerror})") from None
    img = open_image(data, str(path))
    return {"type": "image", "image": data, "size": img.size}
