"""What turns upstream bytes into facts we vouch for: signatures, hashes, verified package
records."""
