"""What every stage needs from the machine it runs on, and nothing about pruning.

- device.py       where a model and its inputs go (one placement for every stage)
- distributed.py  torchrun: ranks, data-parallel splits, gathers
- finite.py       NaN / inf checks that name the tensor or layer
- atomic.py       the one way results are written: atomic folders, the output lock, strict JSON
- cache.py  Where moeprune keeps what it reuses across runs: trained demo models, and the record of
  the quantization environment `moeprune setup quantize` made (so `prune ...
- progress.py  Progress for every stage a person waits on: bars on a terminal, plain lines elsewhere
- runlog.py  `moeprune.log`: what a run did, for the person who finds its output folder weeks later
- timer.py  Wall time per named stage, for reports and the log
"""
