"""Moved to moeprune.allocate.fitness."""

from moeprune._moved import moved

moved(__name__, "moeprune.allocate.fitness")
