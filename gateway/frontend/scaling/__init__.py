"""Several API-server processes behind one port (`--api-server-count`): the supervisor, each
API server's process shell and the folder they share.
"""
