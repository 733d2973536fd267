"""What happens to the chosen experts: drop, novices (MoNE), neurons (ENP), TENP and merge, each in a
virtual form (reversible masks, for the search and evaluation) and a physical one (surgery).

- registry.py  the Method spec, METHODS, and what a plan builder is given
- drop.py      the drop method's plan (its removal is models/reshape.py)
- novice.py    experts replaced by their mean output
- neurons.py   experts narrowed to their most important neurons
- tenp.py      TENP's whole experts plus neuron-pruned ones
- merge.py     removed experts merged into kept ones (REAM-style); merging.py its arithmetic
- mixed.py     whole, narrowed, novice and dropped experts in one layer, under one budget
- auto.py      auto: the portfolio of recipes it chooses among on the search data
- genes.py     a mixed gene and its rules (`LayerGene`, `LayerCosts`, `check_genes`)
- lowrank.py   low-rank novices (`--novice-rank R`), fitted in closed form
- fit_holdout.py  fits that hold: ridge strength and rank of each low-rank novice chosen on held-out
  tokens, never worse there than the constant novice
- widths.py    the widths a narrowed expert may keep (`--width-multiple`), super experts' neighbours
- plans.py     any plan applied virtually or physically, from one resolution
- planning.py  scores and a budget to a plan, for any method
- parameters.py  parameters kept, per layer and in total, and what vLLM holds (width groups)
- sizes.py     what the parts of a model weigh in the saved format, and `kept_bytes`: the one price of
               what each layer keeps (planned bytes, quantized bytes, the precision tables)
- target_size.py  the bytes a prune will write, and the sparsity a `--target-size` asks for
"""

from __future__ import annotations

# Importing registers the methods; this order is the table's.
# isort: off
from moeprune.surgery import drop  # noqa: F401
from moeprune.surgery import novice  # noqa: F401
from moeprune.surgery import neurons  # noqa: F401
from moeprune.surgery import tenp  # noqa: F401
from moeprune.surgery import merge  # noqa: F401
from moeprune.surgery import mixed  # noqa: F401
from moeprune.surgery import auto  # noqa: F401

# isort: on
from moeprune.surgery.registry import METHODS

__all__ = ["METHODS"]
