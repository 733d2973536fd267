"""Moved to moeprune.search.auto."""

from moeprune._moved import moved

moved(__name__, "moeprune.search.auto")
