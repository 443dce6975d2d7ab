"""Code shared by every service: schemas, config, engine, model."""
