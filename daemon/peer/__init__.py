"""The peer socket transport: a Unix socket with descriptor passing, session liveness and the lease
hot path; bounds on what one connection can make hwrd hold.
"""
