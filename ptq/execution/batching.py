"""How many windows go through a model at once (`--batch-size`, `auto` by default), and backing off
after a GPU out-of-memory.

`auto`: on CUDA, as many windows as the free GPU memory holds (torch.cuda.mem_get_info) by the
estimate of `window_bytes` (the full-vocabulary logits dominate: vocab x seq_len per window, in the
compute dtype and again in float32 for the metrics, and the baseline's probabilities; plus the
hidden states of one decoder block; for calibration, no metrics but the observers' transient copies
of an input); on the CPU, 4 (the old default). An automatic batch size halves and retries a batch
that runs out of GPU memory (calibration restarts from its first batch, ptq.calibration.calibrate);
an explicit one does not: the run stops with one line that names what did not fit and the way out
(ptq.runtime.devices.out_of_memory).
"""

from __future__ import annotations

import torch
from torch import nn

from ptq.errors import PtqError
from ptq.runtime.devices import WAYS_OUT, input_device, out_of_memory, release

AUTO = "auto"
CPU_BATCH_SIZE = 4
MAX_AUTO_BATCH_SIZE = 64
# an explicit size above this (more windows than any run has) is capped to it
MAX_BATCH_SIZE = 2**31 - 1
GPU_MEMORY_FRACTION = (
    0.7  # of the free memory, for the activations (allocator fragmentation, cuBLAS workspaces)
)


def parse_batch_size(value: str | int | None) -> int | None:
    """`--batch-size`: a positive integer, or "auto" (None)."""
    if value is None or str(value).strip().lower() == AUTO:
        return None
    try:
        size = int(str(value).strip())
    except ValueError:
        size = 0
    if size < 1:
        raise PtqError(f"--batch-size must be a positive integer or 'auto', not {value!r}")
    return min(size, MAX_BATCH_SIZE)  # more than there are windows is all of them in one batch


def window_bytes(
    config,
    seq_len: int,
    dtype: torch.dtype,
    models: int = 1,
    *,
    calibrating: bool = False,
    logits: bool = True,
) -> int:
    """Estimated GPU memory one window of `seq_len` tokens needs while `models` variants score it:
    each variant's logits in the compute dtype and, one window at a time, in float32 (the metrics);
    the baseline's probabilities in float32, kept for the batch; the hidden states of one decoder
    block (residual, norm, q/k/v, attention output, the MLP's intermediate activations) in the
    compute dtype, and with eager attention its scores.

    calibrating: one model observed instead of scored: its logits in the compute dtype only when it
    computes them (`logits`: calibration skips the lm_head unless it is calibrated), no metrics, no
    probabilities; plus what an observer holds for a moment while it measures the widest input (the
    MLP's intermediate activations): a float32 copy, its int32 bit pattern and the int64 bin index
    of its histogram, 16 bytes an element (ptq.calibration.observers.histogram)."""
    # A multimodal model's (Gemma 3 4B+, Mistral 3, Llama 4) sizes are in its text config, not at
    # the top level
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(config, "vocab_size", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    intermediate = getattr(config, "intermediate_size", 0) or 4 * hidden
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    block = seq_len * (8 * hidden + 3 * intermediate) * size
    # Eager attention (Gemma 2's and gpt-oss' default; "ptq..." is ptq.quantization.attention's,
    # eager too) holds one layer's scores, heads x seq_len^2, in the compute dtype, their float32
    # softmax and its cast back; fused SDPA none
    attention = getattr(config, "_attn_implementation", None)
    if isinstance(attention, str) and (attention == "eager" or attention.startswith("ptq")):
        block += (
            (getattr(config, "num_attention_heads", 0) or 0) * seq_len * seq_len * (2 * size + 4)
        )
    if calibrating:
        return (
            (seq_len * vocab * size if logits else 0)
            + block
            + seq_len * max(hidden, intermediate) * 16
        )
    # + the baseline's float32 probabilities
    logits_bytes = seq_len * vocab * (size + (4 if models > 1 else 0))
    return logits_bytes + block


def auto_batch_size(
    model: nn.Module | list[nn.Module],
    seq_len: int,
    windows: int,
    models: int = 1,
    *,
    calibrating: bool = False,
    logits: bool = True,
) -> int:
    """The batch size `auto` stands for: on CUDA from the free memory and `window_bytes`
    (`calibrating` and `logits` passed on), at most the number of windows and MAX_AUTO_BATCH_SIZE;
    on the CPU (and for a model on the meta device, run layer by layer), CPU_BATCH_SIZE. For a list
    of models (a compare's baseline and variants), the smallest: a variant that quantizes attention
    computes it eagerly, its scores held per window."""
    if isinstance(model, list):
        return min(
            auto_batch_size(m, seq_len, windows, models, calibrating=calibrating, logits=logits)
            for m in model
        )
    device, param = input_device(model), next(model.parameters(), None)
    if param is None or device.type != "cuda":
        return max(1, min(CPU_BATCH_SIZE, windows))
    # with --device-map, of the GPU the inputs and logits are on
    free, _ = torch.cuda.mem_get_info(device)
    per_window = max(
        1,
        window_bytes(
            model.config, seq_len, param.dtype, models, calibrating=calibrating, logits=logits
        ),
    )
    return max(1, min(MAX_AUTO_BATCH_SIZE, windows, int(free * GPU_MEMORY_FRACTION // per_window)))


def back_off(
    size: int,
    auto: bool,
    what: str,
    error: str,
    estimate: int | None = None,
    ways_out: str = WAYS_OUT,
) -> int:
    """After a CUDA out-of-memory at batch size `size`: the halved size to retry with (automatic
    batch sizes only), or the one-line error (an explicit batch size, or a single window that does
    not fit). Call it outside the `except` block, with the error's message: the exception's frames
    would keep the batch's tensors alive."""
    release()
    if not auto or size <= 1:
        raise out_of_memory(what, error, estimate, ways_out) from None
    return size // 2
