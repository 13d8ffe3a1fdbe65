"""Which groups will be dead: pass-rate posteriors, the answer allocator, the curriculum's
prompt sampler and the no-signal alarm (tensor maths, below the config)."""
