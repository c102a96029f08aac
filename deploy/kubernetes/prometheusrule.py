"""Render ``prometheusrule.yaml`` (Prometheus Operator) from the plain rules file.

``deploy/prometheus/kvpressure-rules.yml`` is the source; this wraps its ``groups`` in a
``PrometheusRule`` object, keeping its text (comments, runbooks) as it is.
``tests/test_deploy.py`` fails when the committed file is stale. Regenerate with::

    .venv/bin/python deploy/kubernetes/prometheusrule.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULES = HERE.parent / "prometheus" / "kvpressure-rules.yml"
OUT = HERE / "prometheusrule.yaml"

HEADER = """\
# Generated from deploy/prometheus/kvpressure-rules.yml by deploy/kubernetes/prometheusrule.py;
# do not edit. The Prometheus Operator loads it when the Prometheus object's ruleSelector
# matches these labels (kube-prometheus-stack selects `release: <its release name>`).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvpressure
  namespace: kvpressure
  labels:
    app.kubernetes.io/name: kvpressure
spec:
"""


def render() -> str:
    """Return the PrometheusRule YAML text."""
    text = RULES.read_text(encoding="utf-8")
    body = text[text.index("\ngroups:") + 1 :]
    return HEADER + "".join(f"  {line}" if line.strip() else line for line in body.splitlines(True))


def main() -> int:
    """Write ``prometheusrule.yaml`` next to this file."""
    OUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
