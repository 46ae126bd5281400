"""The registry of canonical checkpoints: registration, fingerprints, descriptors opened with the
caller's rights (never the daemon's).
"""
