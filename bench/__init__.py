"""Benchmarks: the tooling behind the README's figures, kept apart from the files you fork.

Run each from the repository root as a module, so that it imports the project's own files:

    python -m bench.speed             # loop vs a bare loop, device loader vs DataLoader, lr_find's
                                      # overhead, images/s; --device cuda is half the GPU self-check
    python -m bench.lr_find_rules     # lr_find's suggestion rules against a grid of learning rates
                                      # and against torch-lr-finder, and their stability (~12 min on 2 cores)
    python -m bench.figures           # docs/lr_find.png, training.png and confusion.png for the README

A fork that does not need them deletes this folder; nothing outside it imports it.
"""
