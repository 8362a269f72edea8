"""The engine client (API-server process): its connections to one or more engine cores,
admission, load balancing and liveness.
"""
