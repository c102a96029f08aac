"""Pick the NVML binding a ``gpu.binding`` spec names: the real library or the fake.

Kept apart from both so neither imports the other: :mod:`agent.samplers.nvml_binding` wraps
whatever library it is given, :mod:`agent.samplers.fake_nvml` imitates ``pynvml``, and both
share only :mod:`agent.samplers.nvml_codes`. The fake is imported only when a ``fake:`` spec
asks for it, so an agent on a real GPU never loads it.
"""

from __future__ import annotations

from typing import Any

from kvpressure.agent.samplers import nvml_codes
from kvpressure.agent.samplers.nvml_binding import NvmlBinding


def bind(spec: str = "nvml", **fake_options: Any) -> NvmlBinding:
    """Return the binding ``spec`` names.

    Args:
        spec: ``"nvml"`` for the real library (``pynvml`` from nvidia-ml-py), or
            ``"fake:<profile>"`` for a fake loaded from
            ``agent/samplers/fake_nvml/profiles/<profile>.yaml`` (e.g. ``fake:h200``) or
            from a profile file (``fake:/path/profile.yaml``).
        **fake_options: passed to :class:`agent.samplers.fake_nvml.FakeNvml` (``clock``,
            ``gpus``, fault overrides); rejected for ``"nvml"``.

    Returns:
        A binding; nothing is initialised yet. Without nvidia-ml-py installed, the ``"nvml"``
        binding's :meth:`~agent.samplers.nvml_binding.NvmlBinding.init` raises
        ``library_not_found``.

    Raises:
        ValueError: an unknown spec, or options given for the real library.
        FileNotFoundError: no such fake profile.
    """
    if spec == "nvml":
        if fake_options:
            raise ValueError("options are only accepted by fake bindings")
        return NvmlBinding(nvml_codes.library(), "nvml")
    if spec.startswith("fake:"):
        from kvpressure.agent.samplers.fake_nvml import FakeNvml

        profile = spec.removeprefix("fake:")
        return NvmlBinding(FakeNvml.from_profile(profile, **fake_options), spec)
    raise ValueError(f"unknown NVML binding {spec!r}; expected 'nvml' or 'fake:<profile>'")
