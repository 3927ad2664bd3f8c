"""glm5.parallel: process groups (`init_distributed`, `DistContext`, TP / EP / DP groups),
collectives as ops (`all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all`, defined in
glm5.ir.ops_comm, served by torch.distributed or a backend's own implementation) and their
faults (`CollectiveError`: a rank that dies or hangs never hangs the others), the model layouts
that cut a built model over TP / EP / DP-attention ranks (`glm5.parallel.layouts`) and sharded
checkpoint loading (`glm5.parallel.loading`).

A wing above `glm5.core`: it takes a model and cuts it. The model and the engine never import
it (they run whatever modules it puts in place); it reads the FlashComm token threshold from
the planner's cost model (`glm5.deploy.flashcomm`). Formerly `glm5.dist`, which still imports
with a deprecation warning. See docs/distributed.md."""

from glm5.parallel.comm import (
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
from glm5.parallel.faults import CollectiveError, CollectiveTimeout, PeerLost
from glm5.parallel.groups import (
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
