"""The serving engine: sequences, KV block manager, scheduler, sampler, runner."""
