"""The only code that imports aiohttp.web: routes, middleware, auth, responses, the TLS server,
logs."""
