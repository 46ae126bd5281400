"""hwrctl, the operator's CLI: a client application of the daemon (it imports only the client
library and the protos).
"""
