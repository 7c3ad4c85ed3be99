"""A researcher's own package: a hook, a model and a dataset used through expkit."""
