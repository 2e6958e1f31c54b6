"""Benchmarks for chatlane; each module is a script (see ``bench/README.md``)."""
