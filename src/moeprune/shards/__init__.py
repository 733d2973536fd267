"""Work on safetensors shards without loading the model: streamed weight scores, and rewriting a
checkpoint with experts dropped or neurons cut, a tensor (or a byte range) at a time.

- layout.py   a checkpoint's tensors mapped onto its MoE layers; streamed scores; the drop rewrite
- neurons.py  the uniform neuron-shrink rewrite
"""
