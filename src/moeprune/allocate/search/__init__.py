"""EvoESAP: the search for per-layer expert budgets, and choosing the criterion automatically.

- evo.py         population, mutation, the generation loop, checkpoint and resume
- candidates.py  a candidate's fitness through reversible masks (prefix reuse, racing, torchrun)
- fitness.py     ESAP / SAP / KL / NLL on answer positions, and the teacher cache
- auto.py        `criterion auto`: the best uniform plan over every deterministic criterion
"""
