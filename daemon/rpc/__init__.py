"""The gRPC transport: a thin adapter from proto messages to the service, typed errors mapped to
status codes in one table.
"""
