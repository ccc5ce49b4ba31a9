"""Adapters for outbound HTTP: the only code that talks to upstream registries."""
