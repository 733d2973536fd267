"""What lets other engines load a moeprune result: the vLLM plugin and the self-contained
modeling files that stock transformers loads with trust_remote_code.

- moeprune_format.py: the one reader of the on-disk format (standard library only), shared by
  moeprune, the modeling files and the vLLM plugin
- modeling_moeprune.py, moeprune_families.py, moeprune_layers.py, moeprune_loading.py,
  moeprune_novices.py (and moeprune_format.py, moeprune_quantized.py): copied into every moeprune-format folder; they import torch, transformers
  and safetensors only, never moeprune
- moeprune_quantized.py: decodes the quantized weights a result kept (fp8 blocks, MXFP4,
  compressed-tensors), for the modeling files and for moeprune's own reader (moeprune.quant)
- vllm_plugin.py, vllm/: the vLLM plugin (entry point `moeprune`)

Importing this package must stay cheap: vLLM imports moeprune.serve.vllm_plugin at start-up, and
nothing here may pull in moeprune's pipeline (observation, search, evaluation).

- vllm_native.py  vLLM 0.33's own description of a constant-novice result, so stock vLLM >= 0.33
  serves it
"""
