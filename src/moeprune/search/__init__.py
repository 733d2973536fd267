"""EvoESAP: the search for per-layer expert budgets, and choosing the criterion automatically.

A stage after surgery: a candidate is a plan applied through surgery's reversible masks. Its
allocation (`evo`) is declared in allocate/searched.py and its fitnesses in allocate/fitness.py.

- space.py       the SearchSpace protocol (initial, feasible, repair, mutate, describe) and
                 CountSpace: drop counts are one more space
- evo.py         the one evo driver: EvoSearch(evaluate, space, seeds) with its generation loop,
                 fitness cache, checkpoint and resume, for every space
- population.py  the drop counts' feasibility, initial population and mutation
- candidates.py  a candidate's fitness through reversible masks (prefix reuse, racing, torchrun)
- prefix.py      cached decoder-layer outputs shared by candidates with a common prefix
- teacher.py     the full model on the search data, prepared once (SharedTeacher: one pass for a contest)
- run.py         the resumable driver (search_allocation, run_evo_search)
- mixed_space.py `--method mixed --allocation evo`: per-layer genes, the seeds, mutation, the exact budget
- mixed_search.py its driver (search_mixed: EvoSearch over MixedSpace)
- training.py    the gradient allocation's one training loop, with a pluggable Relaxation
- gradient.py    `--allocation gradient` of drop counts: the keep-logit relaxation (KeepLogits)
- gradient_mixed.py  its mixed plans: per-expert form logits (whole, narrowed, novice, dropped)
- form_training.py  the form-logit relaxation (FormLogits): forms, their costs, the forward
- form_projection.py  the exact budget for per-expert forms, from one score per (expert, form)
- document.py    search.json as one typed SearchDocument, written by every search, read back typed
- auto.py        `criterion auto`: the best uniform plan over every deterministic criterion
- portfolio.py   `--method auto`'s contest: the recipes scored on shared work, successive halving
- options.py     SearchRuntime: how a search runs, none of which changes its result
- registry.py    the searches keyed by (allocation, method genes): SEARCHES, search_for(config)
- forms.py       the two searches over forms (evo, gradient), registered

The joint searches of quantization schemes with counts or forms are spaces of the quantize
stage (quantize/evo_space.py, quantize/mixed_space.py), which runs them through the same EvoSearch.
"""
