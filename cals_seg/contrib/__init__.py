"""Experiments kept beside the core: measured, documented, not part of the toolkit's defaults.

The core (everything else in ``cals_seg``) never imports this package. Each module registers its
entries into the core's registries (losses, calibrators, margin rules) when it is imported, so a
user opts in either in Python::

    import cals_seg.contrib.auto_margin  # registers `margin: auto`

or in a config, with a top-level key (or inside a setup file's method entry)::

    contrib: [auto_margin]

which imports exactly those modules of this folder and nothing else
(:func:`cals_seg.utils.registry.enable_contrib`). What each experiment gave, and why it is not in
the core, is in ``docs/studies/``.
"""
