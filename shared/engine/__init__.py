"""The serving engine: sequences, KV block pool and per-sequence KV cache manager, scheduler, sampler, runner."""
