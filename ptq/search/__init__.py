"""`ptq search`: the fewest units kept in 16-bit so that a recipe meets a quality budget.

Between evaluation (which it runs configurations through) and reporting (which renders its record):
units (what the engine serves as one layer), each configuration as a recipe (the chosen recipe with
the kept units in its `ignore` list, exactly what searched.yaml holds), sensitivity, the selection
over the ranked units, and the held-out verification with its baselines."""
