"""Model definition, configuration and weight loading."""
