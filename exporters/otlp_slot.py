"""The OTLP exporter the config asks for (``otlp_export:``), kept equal to it across reloads.

Importing this module does not load OpenTelemetry; :mod:`exporters.otlp` is imported when an
endpoint is set.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvpressure.agent.state import AgentState

if TYPE_CHECKING:
    from kvpressure.agent.config import OtlpExportConfig
    from kvpressure.exporters.otlp import OtlpExport

log = logging.getLogger("kvpressure.exporters.otlp")


class ExportSlot:
    """The OTLP exporter ``otlp_export:`` asks for, started, kept or replaced on reload.

    Its counters are rendered with the agent's own metrics
    (:meth:`agent.state.AgentState.add_health`, name ``otlp-export``) while it runs.

    Args:
        state: the agent state (the metric snapshot, and where the health goes).
    """

    def __init__(self, state: AgentState) -> None:
        self.state = state
        self.export: OtlpExport | None = None
        self._key: object = None

    def apply(self, section: OtlpExportConfig, span_parent: str) -> None:
        """Start, keep or replace the exporter so it matches ``section`` (off: no endpoint)."""
        key = (section, span_parent) if section.endpoint else None
        if key == self._key:
            return
        old, self.export, self._key = self.export, None, key
        if old is not None:
            self.state.remove_health("otlp-export")
            old.shutdown(0.5)
        if not section.endpoint:
            return
        from kvpressure.exporters.otlp import (
            OtlpExport,
        )  # OpenTelemetry is loaded only when exporting

        s = section
        self.export = OtlpExport(
            self.state, s.endpoint, s.headers, s.interval_s, s.queue_size, s.timeout_s,
            span_parent, export_metrics=s.metrics,
        )  # fmt: skip
        self.export.start()
        self.state.add_health("otlp-export", self.export.health_samples)
        log.info("OTLP export on", extra={"kv": {"endpoint": s.endpoint}})
