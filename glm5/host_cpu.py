"""The host CPU's instruction-set flags, read at run time (standard library only): the one
reader of /proc/cpuinfo for the kernels that pick a code path by ISA and for the measurement
helpers that report it."""

from __future__ import annotations

_flags: list[frozenset[str] | None] = []


def cpu_flags() -> frozenset[str] | None:
    """The first CPU's feature flags (Linux /proc/cpuinfo ``flags`` line, read once); None
    where /proc/cpuinfo cannot be read, an empty set where it has no flags line (e.g. Arm,
    which calls them ``Features``)."""
    if not _flags:
        found: frozenset[str] | None = frozenset()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        found = frozenset(line.split(":", 1)[1].split())
                        break
        except OSError:
            found = None
        _flags.append(found)
    return _flags[0]


def missing(*needed: str) -> str | None:
    """Why the CPU cannot run a path needing the flags ``needed`` ("no /proc/cpuinfo", "CPU
    lacks a, b"), None when it has them all."""
    flags = cpu_flags()
    if flags is None:
        return "no /proc/cpuinfo"
    lack = [f for f in needed if f not in flags]
    return f"CPU lacks {', '.join(lack)}" if lack else None



_model: list[str] = []


def cpu_model() -> str:
    """This CPU's model name (Linux /proc/cpuinfo: x86 "model name", Arm "Model name" or
    "Hardware", other "cpu model"; read once), else what `platform` knows (often just the
    architecture), else "unknown"."""
    if not _model:
        import platform

        found = None
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip().lower() in ("model name", "cpu model", "hardware") and \
                            value.strip():
                        found = value.strip()
                        break
        except OSError:
            pass
        _model.append(found or platform.processor() or platform.machine() or "unknown")
    return _model[0]
