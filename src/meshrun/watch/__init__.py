"""What watches a running job: hangs, stragglers, the NCCL flight recorder, step timing and the machines' system
metrics. (What runs before training -- ``meshrun doctor`` and ``bench`` -- is :mod:`meshrun.diag`.)"""
