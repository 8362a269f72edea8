"""The API-server processes ("front end"): the app and its assembly, routes, the OpenAI
protocol, the engine client, output processing, HTTP hardening and the CLI.
"""
