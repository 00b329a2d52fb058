"""Benchmarks behind ``kvviz bench``; each prints JSON lines with its baseline measured in the same run."""
