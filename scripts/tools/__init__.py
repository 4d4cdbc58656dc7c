"""Developer tools: a small case for the sanitizers, a profiling case, host-overhead measurements."""
