"""``meshrun launch``: torchrun's launcher with the network worked out.

args.py (torchrun's parser plus meshrun's options), net.py (routes, interfaces, reachability), slurm.py (layout from
an allocation), rendezvous.py (the decisions and the printed block), launcher.py (torch's elastic agent for this node),
simulate.py (K agents on loopback), cli.py (``main``).
"""
