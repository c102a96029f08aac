"""``kvpressure export``: write the files the agent ships as package data into a folder.

A user who installs the wheel (``pip install kvpressure``) has no source checkout, yet needs
the Grafana dashboards, the Prometheus rules, the systemd unit and the Kubernetes manifests
that match the installed agent's metric names. They are package data of
``kvpressure.dashboards`` and ``kvpressure.deploy`` (in a checkout: ``dashboards/`` and
``deploy/``), read with :mod:`importlib.resources`, so the same command works from a wheel,
an editable install or a zip.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Final


@dataclass(frozen=True, slots=True)
class Bundle:
    """One kind of exported file.

    Attributes:
        package: import name of the package holding the files (package data).
        sources: ``(folder, ending)`` pairs: the files of ``folder`` ("" for the package's
            top level) whose names end with ``ending`` (a whole name picks one file).
        what: one line for ``--help``.
        keep_folders: write each file under its folder's name (kustomize overlays refer to
            their base by relative path), else all files side by side.
    """

    package: str
    sources: tuple[tuple[str, str], ...]
    what: str
    keep_folders: bool = False


BUNDLES: Final[dict[str, Bundle]] = {
    "dashboards": Bundle(
        "kvpressure.dashboards", (("", ".json"),), "Grafana dashboards (import each JSON file)"
    ),
    "rules": Bundle(
        "kvpressure.deploy", (("prometheus", ".yml"),), "Prometheus recording and alert rules"
    ),
    "systemd": Bundle(
        "kvpressure.deploy",
        (("systemd", ".service"), ("", "kvpressure.yaml")),
        "the systemd unit (Type=notify) and its example config",
    ),
    "kubernetes": Bundle(
        "kvpressure.deploy",
        (("kubernetes", ".yaml"), ("kubernetes-pod-resources", ".yaml")),
        "kustomize folders kubernetes/ (DaemonSet, PodMonitor, PrometheusRule, KEDA "
        "ScaledObject) and kubernetes-pod-resources/ (the opt-in pod-resources variant)",
        keep_folders=True,
    ),
}
"""Exportable bundles by the name given on the command line."""


def bundle_files(name: str) -> list[tuple[str, Traversable]]:
    """Return the files of bundle ``name`` as ``(relative target path, file)``, sorted.

    Raises:
        KeyError: ``name`` is not one of :data:`BUNDLES`.
        FileNotFoundError: the package data is missing (a broken installation).
    """
    b = BUNDLES[name]
    root = resources.files(b.package)
    files: list[tuple[str, Traversable]] = []
    for folder, ending in b.sources:
        where = root.joinpath(folder) if folder else root
        found = [f for f in where.iterdir() if f.is_file() and f.name.endswith(ending)]
        if not found:
            raise FileNotFoundError(f"{b.package}/{folder}: no *{ending} file (package data)")
        files += [(f"{folder}/{f.name}" if b.keep_folders else f.name, f) for f in found]
    return sorted(files, key=lambda rf: rf[0])


def export(name: str, dest: Path, *, force: bool = False) -> list[tuple[Path, str]]:
    """Write bundle ``name`` into folder ``dest`` (created when missing).

    A file that already exists with the same bytes is left alone (``unchanged``); one with
    different bytes is kept and reported (``kept``) unless ``force``, then replaced
    atomically (``written``). Nothing is written when any target is not a regular file.

    Returns:
        ``(path, action)`` per file, action one of ``written``, ``unchanged``, ``kept``.

    Raises:
        KeyError: unknown bundle name.
        OSError: ``dest`` cannot be created or written, or a target is not a regular file.
    """
    files = bundle_files(name)
    plan: list[tuple[Path, bytes, str]] = []
    for rel, f in files:
        data = f.read_bytes()
        target = dest / rel
        if target.exists() or target.is_symlink():
            if not target.is_file():
                raise OSError(f"{target}: exists and is not a regular file")
            if target.read_bytes() == data:
                plan.append((target, data, "unchanged"))
                continue
            if not force:
                plan.append((target, data, "kept"))
                continue
        plan.append((target, data, "written"))
    for target, data, action in plan:
        if action == "written":
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, target)
    return [(t, a) for t, _, a in plan]
