"""Stand-in for IPython, which ``sglang/utils.py`` (0.5.17) imports at load for notebook display helpers only."""
