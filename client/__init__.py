"""hwr.client: the contract package (identity, artifact format, leases, publication)."""
