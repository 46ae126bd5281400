"""The service files that ship in the wheel: ``hwrd.service``, ``hwrd.socket``, ``hwrd.toml`` (the
example configuration), ``sysusers.d/hwrd.conf`` and ``tmpfiles.d/hwrd.conf``.

Data only, no code: ``hwrd install-service`` (``hwr.daemon.app.install_service``) reads them with
``importlib.resources`` and lays them out under ``/etc`` (or ``--prefix``), so a node needs the
wheel and nothing from a checkout.
"""
