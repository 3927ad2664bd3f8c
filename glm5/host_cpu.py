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


_model: list[str | None] = []


def cpu_model() -> str | None:
    """The first CPU's model name (/proc/cpuinfo ``model name``, read once), else
    `platform.processor()`, else None."""
    if not _model:
        found = None
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        found = line.split(":", 1)[1].strip() or None
                        break
        except OSError:
            pass
        if found is None:
            import platform

            found = platform.processor() or None
        _model.append(found)
    return _model[0]
