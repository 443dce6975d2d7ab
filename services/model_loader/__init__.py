"""The model loader: one copy of each model's weights per node, in shared memory."""
