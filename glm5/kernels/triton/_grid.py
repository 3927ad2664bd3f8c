"""Grid policies: how a launcher maps a kernel's logical tile grid onto Triton programs.

The kernels stay vendor-neutral; the calling backend's tuning entry for the op picks the policy:

* ``"grid": "tiles"`` (default): one program per tile, launched as the kernel's natural 1-, 2-
  or 3-D grid. This is what the cuda backend uses.
* ``"grid": "persistent"`` with ``"programs": N``: a 1-D grid of ``min(n_tiles, N)`` programs;
  program ``p`` walks the tiles ``p, p + P, p + 2P, ...`` of the logical grid folded row-major
  to 1-D (tile ``t`` of a grid (G0, G1, G2) is ``((t // G2) // G1, (t // G2) % G1, t % G2)``).
  triton-ascend binds each program to a physical AI core and recommends exactly this form: a 1-D
  grid equal to the core count with a loop over tiles (2-D grids are folded to 1-D anyway,
  tasks beyond the core count run in extra rounds with start-up overhead; triton-ascend
  docs/en/migration_guide/migrate_from_gpu.md, architecture_difference.md).
  ``programs`` may be an int or a zero-argument callable returning one (a backend resolves a
  device property such as the AI-core count lazily, on the first launch).

Every kernel taking part ends its runtime parameters with ``N_TILES, NUM_PROGRAMS`` and one
``GRID_i`` per logical grid dimension after the first, and takes ``PERSISTENT: tl.constexpr``;
``launch`` supplies them. Under the default policy they are passed but unused, so the compiled
default kernel is the one-program-per-tile kernel it always was.

No triton import here: this module only computes grids and arguments.
"""

from __future__ import annotations

from math import prod
from typing import Any

POLICIES = ("tiles", "persistent")

# The grid-policy arguments ``launch`` appends. They vary with the sequence length, so no kernel
# lets Triton specialize on them (``_common.entry_kernel``): Triton would otherwise compile a new
# variant whenever one of them becomes 1 or changes its divisibility by 16 (docs/performance.md,
# "Compilation per variant"; tests/test_triton_compile_count.py).
GRID_ARGS: tuple[str, ...] = ("N_TILES", "NUM_PROGRAMS", "GRID_1", "GRID_2")


def policy(p: dict[str, Any], op: str) -> str:
    """The tuning entry's grid policy, checked."""
    g = str(p.get("grid", "tiles"))
    if g not in POLICIES:
        raise ValueError(f"glm5 triton {op}: tuning 'grid' expected one of {POLICIES}, got {g!r}")
    return g


def programs(p: dict[str, Any], op: str) -> int:
    """The persistent program count of a tuning entry (an int, or a callable resolving one)."""
    if "programs" not in p:
        raise ValueError(f"glm5 triton {op}: tuning 'grid': 'persistent' needs 'programs' "
                         f"(the number of programs to launch, e.g. the AI-core count)")
    v = p["programs"]
    n = v() if callable(v) else v
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"glm5 triton {op}: tuning 'programs' expected a positive int, got {n!r}")
    return n


def launch(kernel: Any, grid: tuple[int, ...], p: dict[str, Any], op: str, *args: Any,
           **kw: Any) -> None:
    """Launch ``kernel`` over the logical ``grid`` (1 to 3 dims of tile counts) under the grid
    policy of tuning entry ``p``. ``args`` are the kernel's own runtime arguments, ``kw`` its
    constexprs and launch options; the grid-policy arguments are appended here."""
    grid = tuple(int(g) for g in grid)
    if not 1 <= len(grid) <= 3 or any(g < 0 for g in grid):
        raise ValueError(f"glm5 triton {op}: a grid of 1 to 3 non-negative dims expected, "
                         f"got {grid}")
    n = prod(grid)
    if n == 0:
        return
    if policy(p, op) == "persistent":
        n_prog = min(n, programs(p, op))
        kernel[(n_prog,)](*args, n, n_prog, *grid[1:], PERSISTENT=True, **kw)
    else:  # one program per tile: NUM_PROGRAMS = N_TILES, the kernel reads its program ids
        kernel[grid](*args, n, n, *grid[1:], PERSISTENT=False, **kw)
