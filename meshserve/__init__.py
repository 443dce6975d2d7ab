"""meshserve: an LLM inference mesh. Code lives in shared/, services/ and kernels/,
installed as meshserve.shared, meshserve.services and meshserve.kernels."""

__version__ = "0.1.0"
