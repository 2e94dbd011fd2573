"""Wire formats the proxy speaks to agents; pure decoding and encoding, no I/O."""
