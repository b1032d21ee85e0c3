"""Export: the quantized model as a compressed-tensors checkpoint, reloaded and verified."""
