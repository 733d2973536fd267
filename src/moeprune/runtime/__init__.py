"""What every stage needs from the machine it runs on, and nothing about pruning.

- device.py       where a model and its inputs go (one placement for every stage)
- distributed.py  torchrun: ranks, data-parallel splits, gathers
- finite.py       NaN / inf checks that name the tensor or layer
- atomic.py       the one way results are written: atomic folders, the output lock, strict JSON
"""
