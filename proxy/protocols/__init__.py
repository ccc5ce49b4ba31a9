"""One module per protocol served, methods named after its operations; no aiohttp.web."""
