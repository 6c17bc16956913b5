"""The paper's experiments and the quickstart: Table 1 (banded attention), Table 2 (training
cost), Table 3 (the model variations), Figures 3-5 (attention pictures), the presets table.

A leaf of the package: only the command line imports it; the core never does.
"""
