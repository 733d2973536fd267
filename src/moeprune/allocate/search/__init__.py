"""Former home of the EvoESAP search, now moeprune.search (fitnesses: moeprune.allocate.fitness).

Its modules remain importable from here, each with a DeprecationWarning (moeprune/_moved.py).
"""
