"""EvoESAP: the search for per-layer expert budgets, and choosing the criterion automatically.

A stage after surgery: a candidate is a plan applied through surgery's reversible masks. Its
allocation (`evo`) is declared in allocate/searched.py and its fitnesses in allocate/fitness.py.

- evo.py         population, mutation, the generation loop, checkpoint and resume
- candidates.py  a candidate's fitness through reversible masks (prefix reuse, racing, torchrun)
- population.py  the budget-preserving population and its mutation
- prefix.py      cached decoder-layer outputs shared by candidates with a common prefix
- run.py         the resumable driver (search_allocation, run_evo_search)
- mixed_space.py `--method mixed --allocation evo`: per-layer genes, the seeds, mutation, the exact budget
- mixed_search.py its search (EvoSearch over genes) and driver (search_mixed)
- gradient.py    `--allocation gradient`: per-expert keep logits trained against the full model
- gradient_mixed.py  its mixed plans: per-expert form logits (whole, narrowed, novice, dropped)
- form_projection.py  the exact budget for per-expert forms, from one score per (expert, form)
- auto.py        `criterion auto`: the best uniform plan over every deterministic criterion
- portfolio.py   `--method auto`'s contest: the recipes scored on shared work, successive halving
- options.py     SearchRuntime: how a search runs, none of which changes its result
- registry.py    the searches keyed by (allocation, method genes): SEARCHES, search_for(config)
- forms.py       the two searches over forms (evo, gradient), registered
- gradient.py    the gradient allocation of drop counts (per-expert keep logits)
- gradient_mixed.py / form_training.py  the gradient allocation of forms, and its training loop

The joint searches of quantization schemes with counts or forms are spaces of the quantize
stage (quantize/evo_space.py, quantize/mixed_space.py), which runs them through this driver.
"""
