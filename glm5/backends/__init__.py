"""The plugin system: API (`Backend`, hook markers, implementation labels), discovery, policy
and selection, and one package per built-in backend."""

from glm5.backends.api import (
    API_VERSION,
    ENTRY_POINT_GROUP,
    REFERENCE,
    Backend,
    KernelEntry,
    call_impl,
    hookimpl,
    hookspec,
    implemented_by,
    recording_impls,
    report_impl,
    run_recorded,
    strict_mode,
)

__all__ = ["API_VERSION", "ENTRY_POINT_GROUP", "REFERENCE", "Backend", "KernelEntry",
           "call_impl", "hookimpl", "hookspec", "implemented_by", "recording_impls",
           "report_impl", "run_recorded", "strict_mode"]
