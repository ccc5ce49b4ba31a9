"""tf-registry-proxy: a caching, verifying proxy for Terraform and OpenTofu registries."""

__version__ = "0.1.0"
