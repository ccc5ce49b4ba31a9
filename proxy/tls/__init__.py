"""The generated CA and server certificate, and the state directory that holds them."""
