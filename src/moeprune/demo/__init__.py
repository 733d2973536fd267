"""The embedded default: a tiny Mixture-of-Experts LM trained on text every Python install has.

Nothing can be downloaded, so the demo and the quality tests build their own model:
`build_corpus` writes a code / prose / math corpus from the standard library and generated word
problems, and `get_demo_model` trains (once, then cached) a small Qwen3-MoE on it (or a
DeepSeek-V3-architecture model: `demo_spec("deepseek_v3")`).

- corpus.py  A local multi-domain corpus (code, prose, math) built only from what ships with Python
- heldout.py  What a trained demo model learned: held-out NLL per domain, routing balance and
  specialisation
- run.py  `moeprune demo`: prune the locally trained demo MoE many ways and compare the results
- train.py  Train a tiny MoE language model on the local corpus, cache it, and measure what it
  learned
"""

from __future__ import annotations

from moeprune.demo.corpus import CORPUS_VERSION, DOMAINS, SPLITS, build_corpus, load_split
from moeprune.demo.heldout import heldout_stats
from moeprune.demo.train import (
    DEEPSEEK,
    DEEPSEEK_FIXTURE,
    DEMO,
    FIXTURE,
    DemoModelSpec,
    demo_spec,
    get_demo_model,
    train_demo_model,
)

__all__ = [
    "CORPUS_VERSION",
    "DEEPSEEK",
    "DEEPSEEK_FIXTURE",
    "DEMO",
    "DOMAINS",
    "FIXTURE",
    "SPLITS",
    "DemoModelSpec",
    "build_corpus",
    "demo_spec",
    "get_demo_model",
    "heldout_stats",
    "load_split",
    "train_demo_model",
]
