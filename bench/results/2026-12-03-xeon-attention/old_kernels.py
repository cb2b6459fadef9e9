"""Loads another build of the kernels (a .so built from an older commit) in place of the
installed one, before anything imports them: the A/B scripts here run each side in turn."""

import importlib.util
import sys


def use_kernels(path: str) -> None:
    import sssd

    spec = importlib.util.spec_from_file_location("sssd._kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sssd._kernels"] = module
    spec.loader.exec_module(module)
    sssd._kernels = module
