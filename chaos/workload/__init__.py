"""Reference training workload used by tests, benchmarks and chaos runs."""
