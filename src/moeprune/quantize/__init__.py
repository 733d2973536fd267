"""`prune --quantize`: the pruned result quantized by llm-compressor, and `--quantize auto:A,B`, each
MoE layer's experts given the scheme that costs the fitness least under a byte target.

A stage after search/: the joint choices of schemes with expert counts or mixed forms are EvoESAP
spaces, and every candidate is scored through surgery's reversible masks with its layers'
experts swapped for fake-quantized copies. quant/ keeps the reading of quantized inputs.

- schemes.py      the schemes and methods as data: one registered record each (how to add one)
- options.py      `QuantizeOptions` and the checks that need no weights
- stage.py        the stage's steps as the pipelines call them: before loading, before and after
                  `prune`, after saving
- fake.py         round-to-nearest fake quantization: llm-compressor's numbers, bit for bit
- pricing.py      the bytes of a quantized result from the model's structure (no weight read)
- tables.py       byte tables per (layer, scheme) from what each layer keeps (surgery/sizes.py prices them)
- keeps.py        what the neurons, tenp, novice and mixed plans keep, priced per (layer, scheme)
- choice.py       the per-layer choice's parts: fake-quantized swaps, losses, the exact choice
- per_layer.py    `auto:` resolved, planned before loading, its teacher and choice after surgery
- grid.py         no `--sparsity`: the sparsity chosen with the schemes over a grid of splits
- evo_space.py    the space of experts removed and scheme per layer (a SearchSpace for EvoSearch)
- evo.py          that joint search run on the full model, seeded with the grid's points
- mixed_space.py  the space of mixed forms and scheme per layer (a SearchSpace for EvoSearch)
- mixed.py        that joint search for `--method mixed`, before loading and on the full model
- memory.py       before loading: do the joint search's fake-quantized copies fit in memory?
- oneshot.py      the saved result quantized in place, driver.py in the quantization environment
- driver.py       llm-compressor's `oneshot`, run as a script in .venv-quant (no moeprune import)
- layout.py       driver.py's part for results in moeprune's format (no moeprune import)
- environment.py  the quantization environment's pins and installs (`moeprune setup quantize`;
                  standard library only: scripts/setup_quant.sh runs it before any environment)
"""

from __future__ import annotations

from moeprune.quantize.options import QuantizeOptions
from moeprune.quantize.schemes import SCHEMES, Scheme

__all__ = ["SCHEMES", "QuantizeOptions", "Scheme"]
