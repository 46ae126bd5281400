"""Wiring: hwrd's command line, the object graph built with its collaborators, start/stop order,
SIGHUP reload, the metrics exposition, and a launcher for tests and demos.
"""
