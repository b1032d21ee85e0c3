"""`ptq search`: the fewest units kept in 16-bit (or at a finer scheme) so that a recipe meets a
quality budget.

Between evaluation (which it runs configurations through) and reporting (which renders its record):
units (what the engine serves as one layer), each configuration as a recipe (the first recipe with
the kept units in its `ignore` list and an override per finer recipe, exactly what searched.yaml
holds), sensitivity, the selection over the ranked steps, and the held-out verification with its
baselines."""
