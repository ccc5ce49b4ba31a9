"""warm, export and import: filling a cache, carrying it, verifying it inside."""
