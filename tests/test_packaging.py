"""The distribution installs one import namespace, ``kvpressure``, and ships its data.

Builds the wheel the way a user's ``pip install .`` does (setuptools, build isolation) and
checks its listing; runs ``kvpressure export`` for every bundle and compares the written
files with the checkout's; and scans every Python file for an import of the source folders'
own names, which would work in a checkout (the repository root is on ``sys.path``) and fail
in an installed wheel.
"""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from kvpressure.agent.cli import main
from kvpressure.agent.export import BUNDLES, bundle_files, export

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("agent", "exporters", "dashboards", "deploy")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (whl,) = out.glob("kvpressure-*.whl")
    return zipfile.ZipFile(whl)


def test_wheel_holds_only_the_kvpressure_namespace(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"kvpressure", next(t for t in top if t.endswith(".dist-info"))}
    assert all(t.startswith("kvpressure") for t in top)
    # the agent, exporters, typed markers, embedded config and fake NVML profiles
    for must in (
        "kvpressure/__init__.py",
        "kvpressure/py.typed",
        "kvpressure/agent/cli.py",
        "kvpressure/agent/default.yaml",
        "kvpressure/agent/py.typed",
        "kvpressure/exporters/prometheus.py",
        "kvpressure/agent/samplers/fake_nvml/profiles/h200.yaml",
    ):
        assert must in names, must
    assert not [n for n in names if n.startswith("kvpressure/tests/") or "/__pycache__/" in n]
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvpressure = kvpressure.agent.cli:main" in wheel.read(entry).decode()


def test_wheel_ships_every_dashboard_rule_file_and_unit(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    shipped = (
        {"kvpressure/dashboards/" + p.name for p in (ROOT / "dashboards").glob("*.json")}
        | {
            "kvpressure/deploy/prometheus/" + p.name
            for p in (ROOT / "deploy" / "prometheus").glob("*.yml")
        }
        | {
            "kvpressure/deploy/systemd/kvpressure.service",
            "kvpressure/deploy/kubernetes/daemonset.yaml",
            "kvpressure/deploy/kubernetes/kustomization.yaml",
        }
    )
    assert len(shipped) >= 8
    assert shipped <= names, sorted(shipped - names)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_unpacked_wheel_runs_without_the_checkout(
    wheel: zipfile.ZipFile, tmp_path: Path
) -> None:
    """The wheel alone (no repository on sys.path, no editable hook) runs the agent."""
    site = tmp_path / "site"
    wheel.extractall(site)
    deps = sysconfig.get_paths()["purelib"]  # the dependencies, not the editable hook:
    # -I -S: no cwd, no user site, no .pth files processed, so `kvpressure` can only come
    # from the unpacked wheel
    boot = f"import sys; sys.path[:0] = [{str(site)!r}, {deps!r}]; "
    py = [sys.executable, "-I", "-S", "-c"]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        code = boot + f"from kvpressure.agent.cli import main; sys.exit(main({list(args)!r}))"
        return subprocess.run(
            [*py, code], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
        )

    where = cli("--version")
    assert where.returncode == 0 and where.stdout.startswith("kvpressure "), where.stderr
    probe = subprocess.run(
        [*py, boot + "import kvpressure.agent as a; print(a.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert probe.stdout.startswith(str(site)), probe.stdout
    assert cli("export", "rules", str(tmp_path / "rules")).returncode == 0
    assert (tmp_path / "rules" / "kvpressure-rules.yml").stat().st_size > 1000

    port = _free_port()
    code = boot + (
        "from kvpressure.agent.cli import main; "
        f"sys.exit(main(['run', '--listen', '127.0.0.1:{port}']))"
    )
    agent = subprocess.Popen(
        [*py, code], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        body = ""
        deadline = time.monotonic() + 30
        # each sampler's first report comes from its own thread: wait for the host's, not
        # for the first sampler_up line (CI once read a body holding only gpu's)
        host_up = 'kvpressure_sampler_up{sampler="host"}'
        while time.monotonic() < deadline and host_up not in body:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    body = r.read().decode()
            except OSError:
                time.sleep(0.2)
        assert 'kvpressure_sampler_up{sampler="host"} 1.0' in body, body[-2000:]
    finally:
        agent.terminate()
        _, err = agent.communicate(timeout=10)
    assert agent.returncode == 0, err[-2000:]


@pytest.mark.parametrize("name", sorted(BUNDLES))
def test_export_writes_the_checkouts_files(name: str, tmp_path: Path) -> None:
    b = BUNDLES[name]
    pkg = ROOT / b.package.split(".", 1)[1]
    expected = {
        (f"{folder}/{p.name}" if b.keep_folders else p.name): p
        for folder, ending in b.sources
        for p in (pkg / folder).iterdir()
        if p.is_file() and p.name.endswith(ending)
    }
    assert expected
    out = tmp_path / "out"
    assert main(["export", name, str(out)]) == 0
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == sorted(expected)
    for n in got:
        assert (out / n).read_bytes() == expected[n].read_bytes(), n


def test_export_keeps_a_changed_file_unless_forced(tmp_path: Path) -> None:
    first = export("rules", tmp_path)
    assert {a for _, a in first} == {"written"}
    target = first[0][0]
    target.write_text("# my local edit\n")
    again = dict(export("rules", tmp_path))
    assert again[target] == "kept"
    assert target.read_text() == "# my local edit\n"
    forced = dict(export("rules", tmp_path, force=True))
    assert forced[target] == "written"
    assert target.read_bytes() == bundle_files("rules")[0][1].read_bytes()
    assert set(dict(export("rules", tmp_path)).values()) == {"unchanged"}


def test_export_refuses_a_target_that_is_not_a_file(tmp_path: Path, capsys) -> None:
    name = bundle_files("systemd")[0][0]
    (tmp_path / name).mkdir()
    assert main(["export", "systemd", str(tmp_path)]) == 1
    assert "not a regular file" in capsys.readouterr().err


def test_export_of_an_unknown_bundle_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["export", "grafana", "/tmp/x"])
    assert e.value.code == 2


def _python_files() -> list[Path]:
    out: list[Path] = []
    for folder in ("agent", "exporters", "dashboards", "tests", "benchmarks", "scripts", "deploy"):
        out += [p for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts]
    return out


def test_no_module_imports_a_source_folder_by_its_own_name() -> None:
    """``import agent`` works in a checkout only; the wheel has ``kvpressure.agent``."""
    bad: list[str] = []
    for path in _python_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n.split(".", 1)[0] in SOURCE_FOLDERS
            ]
    assert not bad, bad
