"""What a person reads beside every output: Markdown drawn from the JSON files (the contract).

- describe.py  `moeprune inspect`: a checkpoint's MoE structure and parameter counts, without
  loading weights
- document.py  report.json of a prune as one typed object: built once by the producer, read by every
  renderer
- eval_plots.py  Evaluation plots (PNG, headless) and `moeprune report DIR`, which redraws
  everything from JSON (a pruned output's model card included)
- eval_report.py  The evaluation report: JSON (the contract) and a Markdown summary drawn from it
- kept.py  What each MoE layer kept, in the units that are true for every method
- model_card.py  The model card (`README.md`) of every pruned output, drawn from its report.json
- parts.py  The nested parts of report.json that its readers use field by field, as small
  dataclasses
- plots.py  PNG plots for reports (matplotlib, Agg backend: no display needed)
- prune_report.py  report.json of a prune: what was done, what it cost and kept, what was measured
- serve_check.py  Records what `moeprune serve-check` measured in the output it checked:
  report.json's `serve_check` part and the model card drawn from it
- summary.py  The few lines a person reads after a command, and the same lines at the head of
  report.md
- tables.py  The documentation's generated tables: criteria, allocations, methods, fitnesses and
  metrics from the registries, and the MoE families of the installed transformers
"""
