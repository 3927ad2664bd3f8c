"""The plugin system: API (`Backend`, hook markers), discovery, policy and selection, and one
package per built-in backend."""

from glm5.backends.api import API_VERSION, ENTRY_POINT_GROUP, Backend, KernelEntry, hookimpl, hookspec

__all__ = ["API_VERSION", "ENTRY_POINT_GROUP", "Backend", "KernelEntry", "hookimpl", "hookspec"]
