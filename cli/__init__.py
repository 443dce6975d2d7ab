"""The `meshserve` command line and what it runs that is not a mesh service: the launcher
(`meshserve up`) and the batch runner (`meshserve batch`)."""
