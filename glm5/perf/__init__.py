"""Performance tools beside the conformance kit: `glm5 bench` (`glm5.perf.bench`), the kernel
autotuners behind `glm5 tune` (`glm5.perf.tune`, `glm5.perf.tune_cpu`, with the device shape
sets of `glm5.perf.device_shapes`) and the measurement helpers they and bench/ share (timing,
peak memory, the machine's roofline ceilings: `glm5.perf.measure`)."""
