"""Moved to moeprune.search.options."""

from moeprune._moved import moved

moved(__name__, "moeprune.search.options")
