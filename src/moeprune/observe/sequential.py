"""Moved to moeprune.shards.sequential (layer-by-layer observation reads the checkpoint's shards)."""

from moeprune._moved import moved

moved(__name__, "moeprune.shards.sequential")
