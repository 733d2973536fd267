"""Moved to moeprune.search.evo."""

from moeprune._moved import moved

moved(__name__, "moeprune.search.evo")
