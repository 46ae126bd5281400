"""hwr: a node-level Host Weight Runtime.

The import names live under this namespace; the folders of the repository map onto it
(``client/`` -> ``hwr.client``, ``daemon/`` -> ``hwr.daemon``, ``dlo_backend/`` ->
``hwr.dlo_backend``, ``protos/`` -> ``hwr.protos``).
"""

__version__ = "0.1.0"
