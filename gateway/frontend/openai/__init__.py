"""The OpenAI-compatible routes of the front end: request models, request -> engine
parameters, the engine driver (non-streaming and SSE), and one module per route group."""
