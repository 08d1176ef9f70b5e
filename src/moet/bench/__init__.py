"""`moet bench`: the engine timed as users run it (decode, prefill, residency, serve) on a named
real shape with random weights or a checkpoint, against a roofline and a peer measured in the same
run. Kernel microbenchmarks live outside the package, in the repository's benchmarks/ folder."""
