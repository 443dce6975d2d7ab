"""Hand-written CPU kernels (C++ torch extensions compiled on first use); see the loaders next to
the Python references, e.g. meshserve.kernels.cpu_build."""
