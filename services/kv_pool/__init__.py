"""The KV pool: the node's KV arena and the references on its blocks."""
