"""Work on safetensors shards without loading the model: streamed weight scores, and rewriting a
checkpoint with experts dropped or neurons cut, a tensor (or a byte range) at a time.

- layout.py         a checkpoint's tensors mapped onto its MoE layers (headers only)
- weight_bytes.py   what the weights weigh in the format a prune writes, from the headers alone
- reader.py         one expert's weights read from the shards at a time
- sequential.py     layer-by-layer observation of a model that does not fit in memory
- weight_scores.py  weight-only criteria scored from the shards
- rewrite.py        the uniform drop written as new shards (byte-range copies)
- out_tensor.py     one tensor of a rewritten shard, described before any byte is written
- internal.py       a rewrite in moeprune's format for families whose disk names are not known
- neurons.py        the uniform neuron-shrink rewrite
- mtp.py            the release's multi-token-prediction layers, pruned with the result

The bytes of a quantized result are the quantize stage's (quantize/pricing.py).
"""
