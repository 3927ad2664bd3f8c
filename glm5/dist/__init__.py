"""glm5.dist: process groups (`init_distributed`, `DistContext`, TP / EP / DP groups),
collectives as ops (`all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all`, defined in
glm5.ir.ops_comm, served by torch.distributed or a backend's own implementation) and their
faults (`CollectiveError`: a rank that dies or hangs never hangs the others). The model and the
engine use glm5.dist through this module; see docs/distributed.md."""

from glm5.dist.comm import (
    CommArgumentError,
    all_gather,
    all_reduce,
    all_to_all,
    collective_impl,
    link_bytes,
    reduce_scatter,
    register_collective,
    unregister_collective,
)
from glm5.dist.faults import CollectiveError, CollectiveTimeout, PeerLost
from glm5.dist.groups import (
    DistConfigError,
    DistContext,
    Group,
    Layout,
    collective_backend,
    destroy,
    get_context,
    init_distributed,
    layout_ranks,
)

__all__ = [
    "CollectiveError", "CollectiveTimeout", "CommArgumentError", "DistConfigError",
    "DistContext", "Group", "Layout", "PeerLost", "all_gather", "all_reduce", "all_to_all",
    "collective_backend", "collective_impl", "destroy", "get_context", "init_distributed",
    "layout_ranks", "link_bytes", "reduce_scatter", "register_collective",
    "unregister_collective",
]
