"""Serving moeprune's checkpoint format (docs/checkpoint-format.md) with stock vLLM.

- layout.py   the per-layer structure read from config.json, and the parameters vLLM holds;
              imports neither vLLM nor torch, so moeprune's model card can use it anywhere
- moe.py      the fused-MoE pieces: per-layer expert counts, width groups, the novice term
- novices.py  a layer's novices (constant or low-rank) as one table outside the fused kernel
- models.py   the `MoePrune*ForCausalLM` classes vLLM builds (subclasses of vLLM's own)

moeprune.serve.vllm_plugin registers the classes with vLLM; nothing here is imported until vLLM
builds one of them.

- touchpoints.py  Every vLLM name moeprune's plugin imports, patches or reads, as one table
- version.py  The vLLM releases moeprune's plugin is tested with, and the one sentence that refuses
  the others
"""
