"""How models are run over the windows, apart from what is computed on them.

Calibration (ptq.calibration.calibrate) and evaluation (ptq.evaluation.evaluate) each have one loop
over batches of windows: calibration observes the inputs of the layers its hooks are on, evaluation
scores the logits of each model. Where the models are and how a batch goes through them is the
executor's part:
- `WholeModels` (here): each model whole, one batch at a time: a model in memory, or placed over the
  GPUs (ptq.execution.placement).
- `LayerByLayer` (ptq.execution.streaming, `--low-memory`): the model read from disk one decoder
  layer at a time, each layer run over every batch before the next one is read.

An executor has `names` (the models, the first one the baseline), `model` (the first, for batch-size
estimates) and `dtype`, `steps(windows, logits)` (the progress bar's length) and `forward(input_ids,
size, logits=..., after_batch=..., advance=...)`, which yields, for each batch of `size` windows in
order, `(batch, outputs)`, where `outputs` yields `(name, logits)` for each model in order (logits
None when `logits` is false: calibration that does not observe the lm_head). Only one model's logits
are alive at a time. `after_batch(i)` is called once batch i has gone through what ran of the models
(calibration's check for non-finite inputs), and `advance(n)` as work is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from ptq.runtime.devices import WAYS_OUT, input_device


class WholeModels:
    """Each model run whole on each batch (`models[name](input_ids=batch)`), in the order of
    `models`. device: where the inputs go, when the models are parts of a model placed by accelerate
    (default: each model's input device)."""

    def __init__(self, models: dict[str, nn.Module], device: torch.device | None = None):
        self.models = models
        self.names = list(models)
        self.model = models[self.names[0]]
        self.devices = {name: device or input_device(m) for name, m in models.items()}
        # where the batches and the logits go (the baseline's device)
        self.device = self.devices[self.names[0]]
        self.dtype = next(self.model.parameters()).dtype
        self.ways_out = WAYS_OUT  # of an out-of-memory
        # No KV cache: one forward per window, and the cache (every layer's keys and values for the
        # whole batch, as large as the logits or larger) would stay alive until the logits are
        # scored, past the batch-size estimate
        self.options = {
            name: {"use_cache": False} if _takes(m, "use_cache") else {}
            for name, m in models.items()
        }

    def steps(self, windows: int, logits: bool = True) -> int:
        return windows * len(self.names)

    def forward(
        self,
        input_ids: torch.Tensor,
        size: int,
        *,
        logits: bool = True,
        after_batch: Callable[[int], None] | None = None,
        advance: Callable[[int], None] = lambda n: None,
    ) -> Iterator[tuple[torch.Tensor, Iterator]]:
        for i, start in enumerate(range(0, len(input_ids), size)):
            batch = input_ids[start : start + size].to(self.device)
            yield batch, self._outputs(batch, logits, i, after_batch)
            advance(len(batch) * len(self.names))

    def _outputs(
        self, batch: torch.Tensor, logits: bool, i: int, after_batch
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        for name in self.names:
            out = self.models[name](input_ids=batch.to(self.devices[name]), **self.options[name])
            yield name, out.logits.to(self.device) if logits else None
            del out
        if after_batch is not None:
            after_batch(i)


def _takes(model: nn.Module, keyword: str) -> bool:
    """Whether the model's forward takes `keyword` (transformers' models all take use_cache; a plain
    module may not)."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return keyword in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )
