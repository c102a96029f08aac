"""``url_parts`` reads engine URLs as ``httpx.URL`` does, without importing httpx (issue 15)."""

from __future__ import annotations

import httpx
import pytest
from test_footprint import fresh_interpreter

from kvpressure.agent.samplers.engines.base import instance_of
from kvpressure.agent.samplers.engines.http import url_parts

URLS = [
    # read by url_parts itself
    "http://127.0.0.1:8000",
    "http://127.0.0.1:80",
    "http://127.0.0.1",
    "https://10.0.0.7:443",
    "https://10.0.0.7:8443/v1",
    "http://Engine-0.Example.COM:8000",
    "http://engine-0.vllm.svc.cluster.local:8000/metrics",
    "http://localhost:00080",
    "http://localhost:65535",
    "http://localhost:99999",
    "http://h:0",
    "http://[::1]:8000",
    "http://[::1]:80",
    "http://[FE80::1]:8000",
    "http://[::ffff:10.0.0.1]:8000",
    "http://a..b:1",
    "http://-:1",
    "http://1.2.3.4.:8000",
    "http://1.2.3:8000",
    "http://1.2.3.04x:80",
    "http://XN--bcher-kva.example:8000",
    "https://h/~a/b.c-d_e//f",
    # handed to httpx
    "HTTP://Host:8000",
    "http://user:pw@host:8000",
    "http://host:8000/metrics?x=1",
    "http://host:8000/a%20b",
    "http://host:8000#frag",
    "http://host:/x",
    "http://xn--bcher-kva.example:8000",
    "http://bücher.example:8000",
    "ftp://host:21",
    "unix://host",
    " http://host:8000",
    "http://[::1%25eth0]:8000",
]
INVALID = ["http://999.1.1.1:8000", "http://[::g]:8000", "http://1.2.3.04:80", "http://h:1:2"]


@pytest.mark.parametrize("url", URLS)
def test_url_parts_are_httpx_urls_parts(url: str) -> None:
    parsed = httpx.URL(url)
    assert url_parts(url) == (parsed.scheme, parsed.host, parsed.port)


@pytest.mark.parametrize("url", INVALID)
def test_a_url_httpx_refuses_is_refused_alike(url: str) -> None:
    with pytest.raises(httpx.InvalidURL):
        httpx.URL(url)
    with pytest.raises(httpx.InvalidURL):
        url_parts(url)
    assert instance_of(url) == url  # the raw URL, as before


def test_plain_http_engines_never_import_httpx() -> None:
    # the engine sampler and its gauge reader built and collected (the engine is down) as
    # `kvpressure run` runs them: plain-HTTP engines are read through KeptAlive alone
    code = (
        "import sys\n"
        "from kvpressure.agent.samplers.engines import make_engine_sampler\n"
        "from kvpressure.agent.samples import Batch\n"
        "s = make_engine_sampler('v', 'http://127.0.0.1:9', 'vllm', timeout_s=0.5)\n"
        "g = s.gauge_sampler(0.1)\n"
        "s.collect(Batch()); g.collect(Batch())\n"
        "print(s.instance, 'httpx' in sys.modules)"
    )
    assert fresh_interpreter(code) == "127.0.0.1:9 False"
