"""The on-disk artifact store of one root: staging, validation, atomic commit, deny/quarantine,
retirement and usage accounting. Knows nothing of sessions, leases or transports.
"""
