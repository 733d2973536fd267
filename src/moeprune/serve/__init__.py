"""What lets other engines load a moeprune result: the vLLM plugin and the self-contained
modeling file that stock transformers loads with trust_remote_code.

Importing this package must stay cheap: vLLM imports moeprune.serve.vllm_plugin at start-up, and
nothing here may pull in moeprune's pipeline (observation, search, evaluation).
"""
