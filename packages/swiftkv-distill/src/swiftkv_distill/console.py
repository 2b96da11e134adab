"""What Lightning prints that no user can act on, silenced wherever a distillation is built (``swiftkv distill fit``,
the main job, the benchmarks): its LitLogger advertisement, the model summary's caveat that it sizes bf16 weights as
fp32, and a torch deprecation raised inside Lightning's own code. Everything else it says (devices, precision,
checkpoints, why a fit stopped) stays."""

from __future__ import annotations

import logging
import warnings

_WARNINGS = (
    r"Precision .* is not supported by the model summary",  # only the summary's "params size (MB)" line is off
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # lightning.pytorch.utilities._pytree on torch 2.13
)
# rank_zero_info's loggers (the pytorch one is the one in use once lightning.pytorch is imported)
_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


def quiet_lightning() -> None:
    """Filter Lightning's unactionable output for the rest of the process (idempotent)."""
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in _INFO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())
