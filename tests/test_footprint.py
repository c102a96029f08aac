"""The agent's resident memory (issue 15): what ``kvpressure run`` sets up to keep it small."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")

ARENAS = r"""
import ctypes, sys, threading
from kvpressure.agent.cli import limit_malloc_arenas
print(limit_malloc_arenas(int(sys.argv[1])), flush=True)
keep = []
def work():
    keep.append([bytearray(2000) for _ in range(200)])  # malloc'd (> pymalloc's 512 B)
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(None).malloc_stats()  # one "Arena n:" block per arena, on stderr
"""


def _arenas(cap: int, env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", ARENAS, str(cap)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return out.stdout.strip(), out.stderr.count("Arena ")


@glibc
def test_run_caps_malloc_arenas_unless_the_environment_chose() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    set_here, arenas = _arenas(1, env)
    assert (set_here, arenas) == ("True", 1)
    # threads that allocate take arenas of their own without the cap
    _, uncapped = _arenas(0, {**env, "MALLOC_ARENA_MAX": "8"})
    assert uncapped > 1
    # the environment's MALLOC_ARENA_MAX wins over the agent's default
    set_here, arenas = _arenas(1, {**env, "MALLOC_ARENA_MAX": "8"})
    assert set_here == "False"
    assert arenas > 1


def fresh_interpreter(code: str) -> str:
    """Run ``code`` in a new interpreter (what it imports is all its own) and return its
    stripped stdout; a failure raises ``CalledProcessError``."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_daemon_imports_no_protobuf_or_opentelemetry_until_a_feature_needs_them() -> None:
    # the OTLP receiver imports its messages on the first export, the exporter when
    # otlp_export.endpoint is set (their own tests show both still work)
    code = (
        "import sys, kvpressure.agent.daemon, kvpressure.agent.cli\n"
        "print(sorted({m.split('.')[0] for m in sys.modules"
        " if m.startswith(('google', 'opentelemetry'))}))"
    )
    assert fresh_interpreter(code) == "[]"


def test_a_node_without_pod_resources_or_basic_auth_imports_no_protobuf_or_bcrypt() -> None:
    # the GPU stage built and ticked as `kvpressure run` builds it (fake GPUs, no kubelet
    # socket, no web config): the pod-resources client, its protobuf messages and bcrypt
    # stay unimported (test_webconfig.py checks basic auth still works with users)
    code = (
        "import sys\n"
        "from kvpressure.agent.config import parse\n"
        "from kvpressure.agent.daemon import Daemon\n"
        "cfg = parse('listen: 127.0.0.1:0\\ndiscovery: {enabled: false}\\n"
        'otlp_receiver: {enabled: false}\\ngpu: {binding: "fake:h100-sxm"}\\n\')\n'
        "stages = Daemon(cfg).pipeline_once()\n"
        "stages.tick()\n"
        "stages.close()\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('google')}),"
        " 'kvpressure.agent.podresources' in sys.modules, 'bcrypt' in sys.modules)"
    )
    assert fresh_interpreter(code) == "[] False False"
