"""The command-line tools, one module each, with ``main(argv) -> exit code`` and ``cli()`` (the
console entry point). ``tools/<name>.py`` are two-line doors to them. Each module imports only
argparse at the top, so ``--help`` answers before torch is loaded."""
