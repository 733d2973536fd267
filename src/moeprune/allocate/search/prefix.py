"""Moved to moeprune.search.prefix."""

from moeprune._moved import moved

moved(__name__, "moeprune.search.prefix")
