"""The package docstring of ``hwr.dlo_backend`` names every module it has (its module map)."""

from __future__ import annotations

import pkgutil
import re

import hwr.dlo_backend as dlo


def test_the_module_map_names_every_module_and_only_modules_that_exist() -> None:
    modules = {info.name for info in pkgutil.iter_modules(dlo.__path__)}
    doc = dlo.__doc__ or ""
    # Module names are lower_snake_case; the map also quotes a CUDA call (``cudaHostRegister``).
    mapped = set(re.findall(r"``([a-z_]+)``", doc[doc.index("Modules, one concept each") :]))
    assert modules - mapped == set(), "modules the map leaves out"
    assert mapped - modules == set(), "names in the map that are no module"
