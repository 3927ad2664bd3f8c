"""Vendor-neutral Triton kernels. Launch parameters (block sizes, warps, stages, grid policy)
come from the calling backend's tuning table; kernels never import backends."""
