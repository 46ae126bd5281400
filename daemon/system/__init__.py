"""The OS boundary and process plumbing: accept loops, socket activation, peer credentials, sd_notify,
filesystem guards, /proc scans, the configuration, log lines and metric instruments.
"""
