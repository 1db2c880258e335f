"""The platform ``kvfabric sim-serve`` runs vLLM on: a CPU-typed ``UnspecifiedPlatform``.

On a machine without an accelerator vLLM resolves ``UnspecifiedPlatform``, whose empty device type stops engine
start ("Device string must not be empty"). vLLM's own ``CpuPlatform`` (``VLLM_TARGET_DEVICE=cpu``) would do, but it
forces the spawn start method and turns async scheduling off, and the server then starts about twice as slowly.
This subclass only names the device: nothing runs on it, since :class:`~kvfabric.sim.executor.SimulatedExecutor`
fabricates every output. :func:`install` sets it as vLLM's current platform in this process (vLLM's CLI does the
same for ``vllm bench``); EngineCore processes forked from it inherit it.
"""

from __future__ import annotations

from vllm.platforms.interface import UnspecifiedPlatform

__all__ = ["SimulatedPlatform", "install"]


class SimulatedPlatform(UnspecifiedPlatform):
    """No kernels, no device memory: a name for vLLM's configuration code."""

    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"


def install() -> SimulatedPlatform:
    """Make :class:`SimulatedPlatform` vLLM's ``current_platform`` (before any engine is configured)."""
    # vLLM: only when the platform is installed
    from vllm import platforms

    current = platforms._current_platform  # resolving it here would probe the machine for nothing
    if isinstance(current, SimulatedPlatform):
        return current
    platform = SimulatedPlatform()
    platforms.current_platform = platform
    return platform
