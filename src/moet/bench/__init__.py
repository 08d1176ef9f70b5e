"""Benchmarks: each prints a table and can write JSON; results go to docs/perf.md by hand,
with device, date, shapes and the roofline they are held to."""
