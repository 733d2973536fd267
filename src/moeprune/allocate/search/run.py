"""Moved to moeprune.search.run."""

from moeprune._moved import moved

moved(__name__, "moeprune.search.run")
