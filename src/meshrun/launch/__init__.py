"""``meshrun launch``: torchrun's launcher with the network worked out.

args.py (torchrun's parser plus meshrun's options), net.py (routes, interfaces, reachability), rendezvous.py (the
decisions and the printed block; the nodes come from :mod:`meshrun.placement` under SLURM and other schedulers),
launcher.py (torch's elastic agent for this node), simulate.py (K agents on loopback), cli.py (``main``).
"""
