"""Benchmark scripts (each run from the repository root) and the GPU suite (`benchmarks.gpu`)."""
