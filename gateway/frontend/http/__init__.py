"""HTTP hardening of the API server (API-server process): errors, auth, limits, middleware,
the drain, the watchdog and tracing.
"""
