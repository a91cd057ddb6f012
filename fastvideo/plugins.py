"""The one loader of user extensions named ``package.module:name`` on a command line: a model family
(``--model_family``), a reward (``--reward``). The package must be importable (on ``PYTHONPATH`` or installed)."""
from __future__ import annotations

import importlib
import re
from typing import Any

# a dotted module path: ``package.module`` (at least one dot, so a plain reward or family name never matches)
MODULE_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def load_object(target: str, flag: str, what: str, help_page: str) -> Any:
    """The object ``name`` of ``package.module:name``; ValueError naming ``flag``, what is wrong and ``help_page``."""
    module_name, _, name = target.partition(":")
    if not module_name or not name:
        raise ValueError(f"{flag} {target!r} is not 'package.module:{what}'; see {help_page}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{flag} {target!r}: cannot import {module_name!r} ({err}); put its package on PYTHONPATH "
                         f"or install it (see {help_page})") from err
    if not hasattr(module, name):
        raise ValueError(f"{flag} {target!r}: {module_name} defines no {name!r} (see {help_page})")
    return getattr(module, name)
