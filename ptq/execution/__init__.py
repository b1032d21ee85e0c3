"""How a model is run: batch sizes, placement over devices, block by block, data-parallel, memory checks."""
