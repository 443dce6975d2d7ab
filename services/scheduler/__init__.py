"""The scheduler: the global queue, routing, and recovery from lost workers."""
