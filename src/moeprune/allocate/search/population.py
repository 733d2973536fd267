"""Moved to moeprune.search.population."""

from moeprune._moved import moved

moved(__name__, "moeprune.search.population")
