"""One bounded HTTP GET, with every failure turned into a short reason instead of an exception.

Engine samplers and their add-ons (llama.cpp ``/slots`` and ``/props``) fetch through
:func:`http_get`, so a refused connection, a timeout or an oversized body is data
(``reason``) and never an exception out of ``collect()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import httpx

MAX_BODY_BYTES: Final = 32 * 1024 * 1024
"""Bodies larger than this are not read (reason ``too_large``); vLLM's is ~100 KiB."""


@dataclass(frozen=True, slots=True)
class HttpResult:
    """The outcome of one GET.

    Attributes:
        status: the HTTP status code; ``None`` when no response arrived.
        content_type: the ``Content-Type`` header, or ``None``.
        body: the decoded body (charset from the header, else UTF-8; undecodable bytes
            replaced); ``""`` when no response arrived.
        reason: ``""`` when a response arrived (whatever its status); otherwise
            ``"connect"`` (refused, DNS, unreachable), ``"timeout"``, ``"too_large"``,
            ``"bad_url"`` or ``"transport"`` (any other transport failure).
    """

    status: int | None
    content_type: str | None
    body: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        """True for a 2xx response."""
        return self.status is not None and 200 <= self.status < 300


Fetch = Callable[[str], HttpResult]
"""``fetch(path) -> HttpResult``: GET ``path`` (e.g. ``"/slots"``) on the engine's base URL."""


def http_get(
    client: httpx.Client,
    url: str,
    timeout_s: float,
    max_bytes: int = MAX_BODY_BYTES,
) -> HttpResult:
    """GET ``url`` with ``client``; never raises.

    Args:
        client: the sampler's HTTP client.
        url: absolute URL.
        timeout_s: seconds allowed for each of connect, read, write and pool.
        max_bytes: bodies beyond this many bytes are abandoned (reason ``too_large``).

    Returns:
        An :class:`HttpResult`; transport failures are reported in ``reason``.
    """
    try:
        with client.stream("GET", url, timeout=httpx.Timeout(timeout_s)) as resp:
            chunks: list[bytes] = []
            size = 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    return HttpResult(resp.status_code, _ctype(resp), "", "too_large")
                chunks.append(chunk)
            raw = b"".join(chunks)
            encoding = resp.charset_encoding or "utf-8"
            try:
                body = raw.decode(encoding, errors="replace")
            except LookupError:  # unknown charset name in the header
                body = raw.decode("utf-8", errors="replace")
            return HttpResult(resp.status_code, _ctype(resp), body)
    except httpx.TimeoutException:
        return HttpResult(None, None, "", "timeout")
    except httpx.ConnectError:
        return HttpResult(None, None, "", "connect")
    except (httpx.InvalidURL, httpx.UnsupportedProtocol):
        return HttpResult(None, None, "", "bad_url")
    except Exception:  # noqa: BLE001 - every other failure is "transport", by design
        return HttpResult(None, None, "", "transport")


def _ctype(resp: httpx.Response) -> str | None:
    value: str | None = resp.headers.get("content-type")
    return value
