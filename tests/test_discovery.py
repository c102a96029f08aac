"""Engine auto-discovery (agent/discovery.py): what it finds and what it tells the operator."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvpressure.agent.config import parse
from kvpressure.agent.discovery import Discovery

CFG = "discovery: {host: 127.0.0.1, ports: [8000, 8080], interval_s: 60}\n"


def test_nothing_answering_is_logged_once_per_port_list(caplog: pytest.LogCaptureFixture) -> None:
    asked: list[str] = []

    def probe(url: str) -> str | None:
        asked.append(url)
        return None

    d = Discovery(probe)
    cfg = parse(CFG)
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.discovery"):
        assert asyncio.run(d.once(cfg)) is False
        assert asyncio.run(d.once(cfg)) is False  # the next round: probed, not logged again
    assert asked == ["http://127.0.0.1:8000", "http://127.0.0.1:8080"] * 2
    told = [r.getMessage() for r in caplog.records]
    assert told == [
        "engine discovery: nothing answered on 127.0.0.1 ports 8000, 8080; probing again every 60 s"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.discovery"):
        asyncio.run(d.once(parse(CFG.replace("8080]", "8080, 30000]"))))  # a reload
    assert len(caplog.records) == 1 and "8000, 8080, 30000" in caplog.records[0].getMessage()


def test_an_engine_found_is_named_by_type_and_nothing_else_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def probe(url: str) -> str | None:
        if url.endswith(":8080"):
            return "llamacpp"
        raise OSError("connection refused")  # a probe error means nothing there

    d = Discovery(probe)
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.discovery"):
        assert asyncio.run(d.once(parse(CFG))) is True
        assert asyncio.run(d.once(parse(CFG))) is False  # known ports are not probed again
    assert set(d.found) == {"llamacpp"}
    assert d.found["llamacpp"].url == "http://127.0.0.1:8080"
    assert [r.getMessage() for r in caplog.records] == ["engine discovered"]


def test_configured_engines_mean_no_empty_discovery_line(caplog: pytest.LogCaptureFixture) -> None:
    cfg = parse(CFG + "engines: [{url: 'http://127.0.0.1:9000', type: vllm}]\n")
    with caplog.at_level(logging.INFO, logger="kvpressure.agent.discovery"):
        asyncio.run(Discovery(lambda _url: None).once(cfg))
    assert caplog.records == []
