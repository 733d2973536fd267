"""Work on safetensors shards without loading the model: streamed weight scores, and rewriting a
checkpoint with experts dropped or neurons cut, a tensor (or a byte range) at a time.

- layout.py         a checkpoint's tensors mapped onto its MoE layers (headers only)
- reader.py         one expert's weights read from the shards at a time
- weight_scores.py  weight-only criteria scored from the shards
- rewrite.py        the uniform drop written as new shards (byte-range copies)
- neurons.py        the uniform neuron-shrink rewrite
"""
