"""Moved to moeprune.search.candidates."""

from moeprune._moved import moved

moved(__name__, "moeprune.search.candidates")
