"""Calibration and search data: local files -> token batches with attention and answer masks.

- loading.py    JSONL / text / parquet / arrow / save_to_disk, mixing, packing, fingerprints
- tokenizer.py  a byte-level tokenizer and BPE training (the demo trains its own)
"""
