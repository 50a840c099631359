"""fedweave_bench_app: a Flower App whose model size is set by its run config."""
