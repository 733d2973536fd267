"""Calibration and search data: local files -> token batches with attention and answer masks.

- files.py      JSONL / text / parquet / arrow / save_to_disk files read into records
- loading.py    records tokenized (answer masks), mixed by weight, packed, fingerprinted
- tokenizer.py  a byte-level tokenizer and BPE training (the demo trains its own)
"""

from moeprune.data.loading import CalibrationData, load_data

__all__ = ["CalibrationData", "load_data"]
