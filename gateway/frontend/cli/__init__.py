"""The `gateway` command line (the process the user starts; `serve` becomes an API server)."""
