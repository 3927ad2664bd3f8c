"""TensorIR kernels compiled with `tvm.compile` for the host CPU (llvm), with an on-disk build
cache. Kernels never import backends: the cpu backend passes a `TVMContext`."""
