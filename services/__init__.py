"""One package per service, plus the meshserve command line."""
