"""Rollout Lens: record GRPO runs rollout by rollout and look at them in a dashboard.

The public API, imported lazily so that `import rollout_lens` stays light (no torch):

    from rollout_lens import RolloutLensCallback   # one line in a TRL GRPO script
    from rollout_lens import Client, ClientError    # read a dashboard from a notebook
    from rollout_lens import Settings               # the ROLLOUT_LENS_* settings
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

# In a source checkout the subpackages sit beside this folder (server/, trainer/, web/,
# migrations/ at the repository's top, as the project lays them out); an installed wheel has
# them inside it. Either way they are imported as rollout_lens.server, rollout_lens.trainer, ...
_checkout = Path(__file__).resolve().parent.parent
if (
    not (Path(__file__).parent / "server").is_dir()
    and (_checkout / "server" / "__init__.py").is_file()
):
    __path__.append(str(_checkout))

if TYPE_CHECKING:
    from rollout_lens.client import Client, ClientError
    from rollout_lens.server.core.config import Settings
    from rollout_lens.trainer.recorder.callback import RolloutLensCallback

__all__ = ["Client", "ClientError", "RolloutLensCallback", "Settings", "__version__"]

_LAZY = {
    "Client": "rollout_lens.client",
    "ClientError": "rollout_lens.client",
    "RolloutLensCallback": "rollout_lens.trainer.recorder.callback",
    "Settings": "rollout_lens.server.core.config",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("rollout-lens")
        except PackageNotFoundError:
            return "0+unknown"
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rollout_lens' has no attribute {name!r}")
