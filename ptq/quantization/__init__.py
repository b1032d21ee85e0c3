"""Quantization: recipes, the plan of what is quantized, and the modules that wrap a layer."""
