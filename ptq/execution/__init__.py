"""How a model is run: batch sizes, placement over devices, layer by layer from disk, executors."""
