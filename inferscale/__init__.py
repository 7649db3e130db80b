"""InferScale: per-user memories encoded once into KV state and injected at request time."""

__version__ = "0.1.0"
