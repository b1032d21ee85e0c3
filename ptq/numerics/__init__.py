"""Number formats (one table of constants) and the fused kernels that round to them."""
